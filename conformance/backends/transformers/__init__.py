"""Hugging Face transformers as a backend (``backend``), with the expectations files of its configurations
beside it (``expectations/``)."""
