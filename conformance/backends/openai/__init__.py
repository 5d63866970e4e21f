"""The ``openai`` backend: a running OpenAI-compatible completions server, graded from top-k logprobs."""
