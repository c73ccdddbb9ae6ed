"""Fine-tuning stream heads against a frozen backbone: data (user jsonl, Magpie
prompts, self-distillation), a feature cache of the frozen backbone, the
multi-stream loss and the training loop.

The names below are imported on first use (the command line reads ``TrainConfig``'s
defaults without loading the rest).
"""

from importlib import import_module

_EXPORTS = {
    "FeatureCache": ".features",
    "build_features": ".features",
    "build_features_from_ids": ".features",
    "load_features": ".features",
    "targets_for": ".features",
    "read_jsonl": ".data",
    "self_distill": ".data",
    "split": ".data",
    "synthesize_prompts": ".data",
    "to_example": ".data",
    "write_jsonl": ".data",
    "head_weights": ".loss",
    "stream_loss": ".loss",
    "TrainConfig": ".config",
    "evaluate": ".trainer",
    "implied_tau": ".trainer",
    "train_heads": ".trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mlx_stream.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
