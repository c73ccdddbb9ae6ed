"""Checkpoint conversion into mlx-lm model folders (GGUF now; HF Llama 2 / OPT in issue 5)."""

from .gguf import convert_gguf, read_gguf

__all__ = ["convert_gguf", "read_gguf"]
