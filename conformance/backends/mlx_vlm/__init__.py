"""mlx-vlm as a backend (``backend``: image, audio and text prompts through mlx-vlm's Gemma 4 models),
how each mlx-vlm model type is called (``families``), what mlx-vlm reads from config.json (``config``), MTP
through mlx-vlm's own assisted decoding loop (``mtp``),
and the expectations files of its configurations beside it (``expectations/``)."""
