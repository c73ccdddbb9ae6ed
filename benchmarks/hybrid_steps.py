"""What verifying drafts costs on a recurrent hybrid (issue 52): a tiny random qwen3_next
(Gated DeltaNet layers beside full attention, ``tests/test_hybrids.py``'s) and one ~10x
larger, on this machine.

A draft step over N nodes runs each recurrent layer's mixer on N rows, row i the path to
node i (:class:`~mlx_stream.cache.RecurrentCache`): N x N tokens in the mixer and N copies
of its state. Timed, round-robin, medians (ms, forward and read-back of the logits, at a
context of 64 tokens): a plain 1-token step; a chain of 4 and a tree of 8 with the rows;
and, for scale, the same N tokens through the model as one causal sequence (what a chain
would cost if the states could simply be trimmed; not exact for a tree). Then end to end
against plain ``mlx_lm.stream_generate`` on the same weights, alternating: our plain
decoding, an oracle chain of 3 (tau 4: the ceiling is 4x) and an oracle 8-node tree, 128
greedy tokens each, outputs checked identical.

    python benchmarks/hybrid_steps.py [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

SIZES = {"tiny": {}, "10x": {"hidden_size": 256, "intermediate_size": 512, "linear_key_head_dim": 64}}


def build(size: str, vocab: int):
    import importlib

    from mlx.utils import tree_map
    from test_any_model import BASE
    from test_hybrids import HYBRIDS

    mod = importlib.import_module("mlx_lm.models.qwen3_next")
    cfg = dict(BASE, model_type="qwen3_next", vocab_size=vocab) | HYBRIDS["qwen3_next"] | SIZES[size]
    if size != "tiny":
        cfg |= {"linear_value_head_dim": 64, "num_hidden_layers": 6, "moe_intermediate_size": 128}
        cfg |= {"shared_expert_intermediate_size": 128, "head_dim": 64}
    mx.random.seed(1)
    m = mod.Model(mod.ModelArgs.from_dict(cfg))
    m.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, m.parameters()))
    mx.eval(m.parameters())
    return m


def step_times(backbone, reps: int, context: int = 64) -> dict:
    from mlx_stream import SpeculativeModel
    from mlx_stream.cache import RecurrentCache, make_tree_cache, mark, rewind
    from mlx_stream.tree import build_tree, chain

    fam = SpeculativeModel(backbone).family
    V = fam.vocab
    ids = mx.arange(context) % V
    cache = make_tree_cache(backbone)
    fam.prefill_forward(backbone, ids, cache)
    marks = mark(cache)
    trees = {"chain 4": chain(3), "tree 8": build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])}

    def rows(t):
        mask = mx.concatenate([mx.ones((t.size, context), dtype=mx.bool_), mx.array(t.mask)], axis=1)
        pos = mx.array(context + t.depths, dtype=mx.int32)
        return lambda: fam.tree_forward(backbone, mx.zeros((t.size,), dtype=mx.int32), pos, mask, cache)[0]

    def causal(n):
        return lambda: fam._run(backbone, mx.zeros((n,), dtype=mx.int32), cache, None)[0]

    runs = {
        "plain step": causal(1),
        **{f"{k}, rows": rows(t) for k, t in trees.items()},
        **{f"{k} tokens, one causal sequence": causal(t.size) for k, t in trees.items()},
    }
    times = {k: [] for k in runs}
    for r in range(reps + 1):
        for k, fn in runs.items():
            tic = time.perf_counter()
            mx.eval(fn())
            if r:
                times[k].append(1e3 * (time.perf_counter() - tic))
            rewind(cache, context, marks)
    out = {k: statistics.median(v) for k, v in times.items()}
    state = sum(a.nbytes for c in cache if isinstance(c, RecurrentCache) for a in c.cache)
    out["recurrent state, MB (one row)"] = state / 2**20
    out["rows' state, MB, tree 8"] = 8 * state / 2**20
    return out


def end_to_end(backbone, tok, reps: int, max_tokens: int = 128) -> dict:
    import mlx_lm

    from mlx_stream import SpeculativeModel, stream_generate
    from mlx_stream.drafters import OracleDrafter
    from mlx_stream.tree import build_tree, chain

    model = SpeculativeModel(backbone)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
    ref = [r.token for r in mlx_lm.stream_generate(backbone, tok, mx.array(ids), max_tokens=max_tokens)]
    V = model.family.vocab
    tree8 = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])

    def mlx_lm_run():
        toks, t0 = [], None
        for r in mlx_lm.stream_generate(backbone, tok, mx.array(ids), max_tokens=max_tokens):
            t0 = t0 or time.perf_counter()
            toks.append(r.token)
        return toks, (len(toks) - 1) / (time.perf_counter() - t0)

    def ours(**kw):
        def run():
            toks, t0 = [], None
            for r in stream_generate(
                model, tok, ids, max_tokens=max_tokens, adaptive=False, prompt_lookup=0, **kw
            ):
                t0 = t0 or time.perf_counter()
                toks.extend(r.tokens)
            return toks, (len(toks) - 1) / (time.perf_counter() - t0)

        return run

    confs = {
        "mlx-lm plain": mlx_lm_run,
        "ours plain": ours(),
        "oracle chain of 3": ours(drafter=OracleDrafter(len(ids), ref, chain(3), V)),
        "oracle 8-node tree": ours(drafter=OracleDrafter(len(ids), ref, tree8, V)),
    }
    res = {k: [] for k in confs}
    for r in range(reps + 1):
        for k, fn in confs.items():
            toks, tps = fn()
            assert toks == ref, k
            if r:
                res[k].append(tps)
    base = res["mlx-lm plain"]
    return {
        k: (statistics.median(v), statistics.median(a / b for a, b in zip(v, base))) for k, v in res.items()
    }


def main(argv=None):
    import tempfile

    import mlx_lm
    from conftest import make_tiny_model_dir
    from mlx.utils import tree_flatten

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tok = mlx_lm.load(str(make_tiny_model_dir(Path(d) / "tok")))[1]
    np.random.seed(0)
    for size in SIZES:
        bb = build(size, len(tok.vocab))
        n = sum(v.size for _, v in tree_flatten(bb.parameters()))
        print(f"\n## qwen3_next {size}: {n / 1e6:.2f} M parameters\n")
        print("| step (context 64) | ms (median) | x plain step |\n|---|---|---|")
        t = step_times(bb, args.reps)
        for k, v in t.items():
            if "MB" in k:
                print(f"| {k} | {v:.3f} | |")
            else:
                print(f"| {k} | {v:.2f} | {v / t['plain step']:.2f}x |")
        print("\n| decoding, 128 greedy tokens, identical | tok/s | x plain mlx-lm |\n|---|---|---|")
        for k, (tps, x) in end_to_end(bb, tok, max(3, args.reps // 3)).items():
            print(f"| {k} | {tps:.0f} | {x:.2f}x |")


if __name__ == "__main__":
    main()
