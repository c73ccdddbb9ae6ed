"""mlx-stream: Speculative Streaming on MLX.

Stream heads on the target model draft a token tree from its last hidden state;
every forward pass verifies the previous tree and drafts the next one, losslessly
(Bhendawade et al., "Speculative Streaming: Fast LLM Inference without Auxiliary
Models", arXiv 2402.11131).

    >>> from mlx_stream import load, generate
    >>> model, tokenizer = load("smollm2-135m-instruct")  # heads="path/to/heads" to speculate
    >>> generate(model, tokenizer, "Hello", max_tokens=32)
"""

from importlib.metadata import PackageNotFoundError, version

from .chat import ChatSession
from .drafters import Drafter, HeadsDrafter, LookupDrafter, NoDrafter, OracleDrafter
from .generate import GenerationResponse, PromptCache, generate, stream_generate
from .loader import DEFAULT_MODEL, load
from .model import SpeculativeModel
from .tree import Tree, build_tree, chain, parse_tree

try:
    __version__ = version("mlx-stream")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "ChatSession", "DEFAULT_MODEL", "Drafter", "GenerationResponse", "HeadsDrafter", "LookupDrafter", "NoDrafter",
    "OracleDrafter",
    "PromptCache", "SpeculativeModel", "Tree", "build_tree", "chain", "generate", "load",
    "parse_tree", "stream_generate",
]
