"""What one decoding step costs, by kind: plain steps queued ahead (mlx-lm's pipelining),
plain steps not queued, and drafting steps over static trees of the shipped heads, queued
ahead and (``--not-queued``) not.

Each kind decodes the same prompts (Spec-Bench, the first of each task group, greedy,
adaptive speculation and prompt lookup off) round-robin; a step's time is the decode's
wall time after the first token over its forward passes. Medians over the prompts.

    python benchmarks/step_times.py [--trees "0 0;1;2;3"] [--max-tokens 64] [--temp 0] [--not-queued]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from mlx_stream import load, stream_generate
from mlx_stream.drafters import HeadsDrafter, NoDrafter
from mlx_stream.prompts import load_spec_bench, prompt_ids
from mlx_stream.tree import no_drafts, parse_tree


class NotQueued:
    """Drafts nothing, as a drafter whose tree changes per step: the loop cannot queue its
    plain steps ahead."""

    capture = None

    def __init__(self):
        self.tree = no_drafts()

    def draft(self, hidden, tokens, mid=None, cache=None):
        return mx.zeros((0,), dtype=mx.int32)

    def propose(self, hidden, tokens, max_depth, mid=None, cache=None, base=True, noise=None):
        return self.tree, mx.zeros((0,), dtype=mx.int32)


class HeadsNotQueued:
    """The heads' static tree, drafted only once the step before is read back (it cannot
    draft from lazy inputs): every drafting step waits for the one before."""

    capture = None
    coupled = True

    def __init__(self, heads: HeadsDrafter):
        self.heads, self.tree = heads, heads.tree

    def draft(self, hidden, tokens, mid=None, cache=None, noise=None):
        return self.heads.draft(hidden, tokens, noise=noise)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default="0 0;1;2;3", help="space-separated static trees of the heads")
    ap.add_argument("--per-group", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--not-queued", action="store_true", help="also each tree with its steps not queued")
    args = ap.parse_args()
    model, tok = load("smollm2-135m-instruct", heads="default", dtype="float32")
    kinds = {"plain, queued ahead": {"drafter": NoDrafter()}, "plain, not queued": {"drafter": NotQueued()}}
    for t in args.trees.split():
        heads = HeadsDrafter(model, parse_tree(t, model.heads.num_heads))
        kinds[f"tree {t}"] = {"drafter": heads, "adaptive": False}
        if args.not_queued:
            kinds[f"tree {t}, not queued"] = {"drafter": HeadsNotQueued(heads), "adaptive": False}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    taus: dict[str, list[float]] = {k: [] for k in kinds}
    for i, it in enumerate(load_spec_bench(per_group=args.per_group)):
        ids = prompt_ids(tok, it["prompt"])
        for kind, kw in kinds.items():
            start = first = None
            for r in stream_generate(
                model, tok, ids, max_tokens=args.max_tokens, temp=args.temp, seed=i, **kw
            ):
                if start is None:
                    start, first = time.perf_counter(), r.forward_passes
                last = r
            steps = max(last.forward_passes - first, 1)
            times[kind].append((time.perf_counter() - start) / steps * 1e3)
            taus[kind].append(last.tau)
    plain = statistics.median(times["plain, queued ahead"])
    print(f"{'kind':24s} {'ms/step':>8s} {'x plain':>8s} {'tau':>6s} {'tau / x':>8s}")
    for kind in kinds:
        ms, tau = statistics.median(times[kind]), statistics.median(taus[kind])
        print(f"{kind:24s} {ms:8.1f} {ms / plain:8.2f} {tau:6.2f} {tau / (ms / plain):8.2f}")


if __name__ == "__main__":
    main()
