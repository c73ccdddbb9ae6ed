"""mlx-stream: Speculative Streaming on MLX.

Stream heads on the target model draft a token tree from its last hidden state;
every forward pass verifies the previous tree and drafts the next one, losslessly
(Bhendawade et al., "Speculative Streaming: Fast LLM Inference without Auxiliary
Models", arXiv 2402.11131).

    >>> from mlx_stream import load, generate
    >>> model, tokenizer = load("smollm2-135m-instruct")  # the shipped heads (heads=None: plain)
    >>> generate(model, tokenizer, "Hello", max_tokens=32)

The names below are imported on first use, so ``import mlx_stream`` (and the
``mlx-stream --help`` command line) does not load MLX or mlx-lm until they are needed.
"""

import sys
import types
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

_EXPORTS = {
    "BudgetDrafter": ".budget",
    "ChatSession": ".chat",
    "Datastore": ".datastore",
    "DraftStore": ".datastore",
    "AnswerStore": ".datastore",
    "DEFAULT_HEADS": ".defaults",
    "DEFAULT_MODEL": ".defaults",
    "Drafter": ".drafters.base",
    "GenerationResponse": ".generate",
    "HeadsDrafter": ".drafters.stream_heads",
    "LookupDrafter": ".drafters.lookup",
    "NoDrafter": ".drafters.base",
    "OracleDrafter": ".drafters.oracle",
    "PromptCache": ".generate",
    "SpeculativeModel": ".model",
    "Tree": ".tree",
    "build_tree": ".tree",
    "cache_prompt": ".prompt_cache",
    "load_prompt_cache": ".prompt_cache",
    "save_prompt_cache": ".prompt_cache",
    "chain": ".tree",
    "load": ".loader",
    "load_draft": ".loader",
    "make_drafter": ".speculation",
    "plan_drafting": ".speculation",
    "build_drafter": ".speculation",
    "parse_tree": ".tree",
    "resolve_tree": ".speculation",
    "stream_generate": ".generate",
}

try:
    __version__ = version("mlx-stream")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = sorted([*_EXPORTS, "generate"])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'mlx_stream' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    # ``mlx_stream.generate`` is the function (``from mlx_stream import generate``), also
    # after the submodule of the same name is imported: the import system's binding of
    # the submodule to this attribute is ignored (sys.modules still holds the module).
    @property
    def generate(self):
        return import_module(".generate", __name__).generate

    @generate.setter
    def generate(self, module):
        pass


sys.modules[__name__].__class__ = _Package
