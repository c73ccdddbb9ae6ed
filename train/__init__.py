"""Fine-tuning stream heads against a frozen backbone: data (user jsonl, Magpie
prompts, self-distillation), a feature cache of the frozen backbone, the
multi-stream loss and the training loop."""

from .data import read_jsonl, self_distill, split, synthesize_prompts, to_example, write_jsonl
from .features import FeatureCache, build_features, build_features_from_ids, load_features, targets_for
from .loss import head_weights, stream_loss
from .trainer import TrainConfig, evaluate, implied_tau, train_heads

__all__ = [
    "FeatureCache", "TrainConfig", "build_features", "build_features_from_ids", "evaluate", "head_weights",
    "implied_tau", "load_features", "read_jsonl", "self_distill", "split", "stream_loss",
    "synthesize_prompts", "targets_for", "to_example", "train_heads", "write_jsonl",
]
