"""The context limit: ``max_position_embeddings`` of config.json (``TextConfig.max_position_embeddings``).

The forward itself takes any length (RoPE has no table to run off), but positions past the limit are beyond
what the checkpoint was trained and published for, so the command-line tools (``refimpl logits``,
``refimpl generate``, ``conformance generate``) refuse such prompts before any forward, unless told
otherwise (``--allow-beyond-context``). A config that states no limit sets none.
"""

from __future__ import annotations

from .config import TextConfig
from .errors import ContextLimitError

OVERRIDE_FLAG = "--allow-beyond-context"


def beyond_context(cfg: TextConfig, length: int) -> bool:
    """Whether ``length`` positions (0 .. length - 1) go past the checkpoint's context."""
    return cfg.max_position_embeddings is not None and length > cfg.max_position_embeddings


def check_context(cfg: TextConfig, length: int, what: str, override: str = OVERRIDE_FLAG) -> None:
    """ContextLimitError when ``length`` positions go past ``cfg``'s context. ``what`` is the start of the
    message and says what is that long (e.g. ``"the prompt is 5001 tokens long"``); ``override`` is how to
    run it anyway."""
    if beyond_context(cfg, length):
        raise ContextLimitError(f"{what}, beyond the checkpoint's context of {cfg.max_position_embeddings} tokens "
                                f"(max_position_embeddings in config.json); pass {override} to run it anyway")


def check_prompt_context(cfg: TextConfig, prompt_length: int, new_tokens: int = 0, new_flag: str = "max_new_tokens",
                         override: str = OVERRIDE_FLAG) -> None:
    """``check_context`` for a prompt of ``prompt_length`` tokens and ``new_tokens`` to generate after it (named
    ``new_flag`` in the message): the last new token is decoded from position prompt_length + new_tokens - 2, so
    the positions run to prompt_length + new_tokens - 1."""
    check_context(cfg, prompt_length, f"the prompt is {prompt_length} tokens long", override)
    n = prompt_length + max(new_tokens - 1, 0)
    check_context(cfg, n, f"the prompt ({prompt_length} tokens) and {new_flag} {new_tokens} need {n} positions",
                  override)
