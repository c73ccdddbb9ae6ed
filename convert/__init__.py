"""Checkpoint conversion into mlx-lm model folders: GGUF (llama architecture) and
Hugging Face Llama 2 / OPT checkpoints."""

from .gguf import convert_gguf, read_gguf
from .hf import convert_hf
from .torch_bin import load_torch_bin

__all__ = ["convert_gguf", "convert_hf", "load_torch_bin", "read_gguf"]
