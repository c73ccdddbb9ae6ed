"""A drafter that knows the answer: the target's own continuation, for tests and for the
loop's ceiling (``mlx-stream bench --drafter oracle``, ``benchmarks/host_overhead.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ..checks import require_int, require_token_ids
from ..tree import Tree, check_depth


class OracleDrafter:
    """Proposes a known continuation (for tests and for measuring the loop's ceiling).

    Given the target's own greedy output for the prompt, the rank-0 path of the
    tree drafts exactly the next tokens of that output, so every draft on it is
    accepted; other ranks draft ``(true token + rank) mod V``, which is wrong.
    With ``wrong=True`` every node drafts a wrong token, so nothing is accepted.

    Args:
        prompt_len: number of prompt tokens.
        continuation: the target's output after the prompt.
        tree: the tree to fill.
        vocab_size: V.
        wrong: draft a wrong token at every depth.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
    """

    def __init__(
        self, prompt_len: int, continuation: Sequence[int], tree: Tree, vocab_size: int, wrong: bool = False
    ):
        require_int(prompt_len, "prompt_len", 0)
        require_token_ids(continuation, "continuation")
        require_int(vocab_size, "vocab_size", 1)
        check_depth(tree, 1 << 10)
        self.prompt_len = prompt_len
        self.continuation = list(continuation)
        self.tree = tree
        self.vocab_size = vocab_size
        self.wrong = wrong
        self._device = None  # (continuation, depths, rank shifts) on the device, made once

    capture = None

    def draft_queued(self, hidden, root, noise=None, length=None) -> mx.array:
        """:meth:`draft` on the device for a step queued before the host knows how many
        tokens precede it: ``length`` is the lazy ``()`` int32 count of tokens up to and
        including the root (the loop passes it); ``hidden``, ``root`` and ``noise`` are
        unused. No host sync, so the loop queues oracle steps as it queues the heads'."""
        if self._device is None:  # the continuation, then 0 (as the host's past its end)
            cont = mx.array(self.continuation + [0], dtype=mx.int32)
            depths = mx.array(self.tree.depths[1:] - 1, dtype=mx.int32)
            shifts = mx.array(self.tree.ranks[1:] + (1 if self.wrong else 0), dtype=mx.int32)
            self._device = (cont, depths, shifts)
        cont, depths, shifts = self._device
        j = mx.clip(length - self.prompt_len + depths, 0, cont.size - 1)
        return (cont[j] + shifts) % self.vocab_size

    def draft(self, hidden, tokens, mid=None, cache=None):
        pos = len(tokens) - self.prompt_len  # index in the continuation of the first draft
        out = []
        for i in range(1, self.tree.size):
            d, r = int(self.tree.depths[i]), int(self.tree.ranks[i])
            j = pos + d - 1
            true = self.continuation[j] if j < len(self.continuation) else 0
            shift = r + (1 if self.wrong else 0)
            out.append((true + shift) % self.vocab_size)
        return mx.array(out, dtype=mx.int32)
