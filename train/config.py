"""Training settings (no MLX import: the command line reads the defaults from here)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# a continued run (``--init-heads``) starts from trained heads: one epoch at a lower peak
# learning rate keeps what they knew (measured in docs/heads.md, "More data, soft targets,
# continued training", its "5x the data" paragraph: two epochs at 1e-3 made head 1 worse on
# held-out prompts, one epoch at 3e-4 the best heads so far)
CONTINUED = {"epochs": 1.0, "lr": 3e-4, "warmup": 20}


@dataclass
class TrainConfig:
    """Training settings.

    Attributes:
        num_heads: K stream heads.
        num_layers: residual blocks per head.
        epochs: passes over the training positions (fractions allowed).
        batch_size: positions (tokens) per micro-batch.
        grad_accum: micro-batches per optimizer step.
        lr: peak learning rate; warm-up is linear over ``warmup`` steps, then cosine to 0.
        warmup: warm-up optimizer steps.
        weight_decay: AdamW weight decay.
        head_decay: loss weight of head j is ``head_decay**(j-1)``.
        kl_weight: weight of the KL to the backbone's own distribution (soft targets;
            0 trains on hard labels only).
        checkpoint_every: optimizer steps between checkpoints (0: only at the end).
        seed: seeds the batch order (one permutation per epoch).
    """

    num_heads: int = 3
    num_layers: int = 1
    epochs: float = 3.0
    batch_size: int = 256
    grad_accum: int = 1
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    head_decay: float = 0.8
    kl_weight: float = 0.0
    checkpoint_every: int = 200
    seed: int = 0

    def __post_init__(self):
        """Raises ``ValueError`` naming the first setting out of range."""
        at_least = {
            "num_heads": 1,
            "num_layers": 1,
            "batch_size": 1,
            "grad_accum": 1,
            "warmup": 0,
            "checkpoint_every": 0,
            "seed": 0,
        }
        for name, low in at_least.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        for name, positive in (
            ("epochs", True),
            ("lr", True),
            ("head_decay", True),
            ("weight_decay", False),
            ("kl_weight", False),
        ):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and (v > 0 if positive else v >= 0)):
                raise ValueError(f"{name} must be a number {'> 0' if positive else '>= 0'}, got {v!r}")
