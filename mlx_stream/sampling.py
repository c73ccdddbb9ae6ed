"""Target distributions shared by plain and speculative decoding.

Both paths turn logits into the same processed distribution at every position, so
verification compares drafts against exactly what plain sampling would draw from.
"""

from __future__ import annotations

import mlx.core as mx


def check_sampling(temp: float) -> None:
    """Raise ``ValueError`` for a negative (or non-finite) temperature."""
    if not isinstance(temp, (int, float)) or temp < 0 or temp != temp or temp == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temp!r}")


def probabilities(logits: mx.array, temp: float) -> mx.array:
    """Softmax of ``logits / temp`` in float32: ``(..., V)`` -> ``(..., V)``.

    Raises:
        ValueError: ``temp <= 0`` (greedy decoding takes the argmax instead).
    """
    if temp <= 0:
        raise ValueError("probabilities() needs temp > 0; greedy decoding uses the argmax")
    return mx.softmax(logits.astype(mx.float32) / temp, axis=-1)
