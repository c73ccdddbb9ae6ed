"""Throughput of `mlx-stream train`'s data stage (self-distillation with the hidden states
kept), next to the matmul GFLOP/s this machine gives in the same run.

    python benchmarks/data_engine.py --prompts benchmarks/data/magpie_256.jsonl \
        --max-tokens 192 --batch-size 64 [--top-k 32]
    mlx.launch -n 2 -- python benchmarks/data_engine.py --prompts ...   # two ranks
    python benchmarks/data_engine.py --prompts runs/grow1/data/valid.jsonl --no-distill

It runs ``mlx_stream.train.pipeline.build_split`` (what ``mlx-stream train`` runs for
each split) on the given prompts into a temporary folder and prints one JSON line:
positions kept (= generated tokens), prompt tokens, wall seconds, positions/s, the
backbone's achieved GFLOP/s (2 x parameters per token, prompt and generated tokens,
attention left out) and the float32 1024^3 matmul GFLOP/s of one thread measured
before and after. The same script runs on older commits (it passes ``top_k`` only
when asked), so before/after comparisons use the very same prompts.

``--profile`` instead times the parts of one batched decode step at ``--batch-size``
rows and ``--cache-len`` cached tokens (medians of 7): the whole step, the layers'
matmuls alone, the output projection, attention over the cache, and mlx-lm's
``BatchKVCache.filter`` (what dropping one finished row costs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def matmul_gflops(n: int = 1024, reps: int = 7) -> float:
    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b, a @ b)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / float(np.median(times)) / 1e9


def _median_ms(f, reps: int = 7) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def profile_step(model, B: int, L: int) -> dict:
    """Milliseconds of the parts of one decode step of ``B`` rows over ``L`` cached tokens."""
    from mlx_lm.models.cache import BatchKVCache

    bb, fam = model.backbone, model.family
    layers = bb.model.layers
    cache = [BatchKVCache([0] * B) for _ in layers]
    x = mx.random.randint(0, 1000, (B, L))
    mx.eval(bb.model(x, cache=cache))
    tok = mx.zeros((B, 1), dtype=mx.int32)

    def step():
        h = bb.model(tok, cache=cache)[:, -1]
        mx.eval(h, mx.argmax(fam.project(bb, h), axis=-1))
        for c in cache:  # rewind, so every repetition sees L cached tokens
            c.trim(1)

    H = model.state_size
    hid = mx.random.normal((B, 1, H))
    mx.eval(hid)

    def matmuls():  # every Linear of every layer on a (B, 1, H) input, chained per block
        outs = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            outs += [a.q_proj(hid), a.k_proj(hid), a.v_proj(hid), a.o_proj(hid)]
            outs.append(m.down_proj(m.gate_proj(hid) * m.up_proj(hid)))
        mx.eval(outs)

    attn = layers[0].self_attn
    q = mx.random.normal((B, attn.n_heads, 1, H // attn.n_heads))
    k, v = (mx.contiguous(a[..., :L, :]) for a in (cache[0].keys, cache[0].values))
    mask = mx.ones((B, 1, 1, L), dtype=mx.bool_)
    mx.eval(q, k, v)

    def attention():
        outs = [mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mask) for _ in layers]
        mx.eval(outs)

    def drop_one_row():
        cc = [BatchKVCache([0] * B) for _ in layers]
        for c, o in zip(cc, cache):
            c.state = (o.keys, o.values, o.offset, o.left_padding, o._idx)
            c.filter(mx.arange(B - 1))
        mx.eval([c.state[:2] for c in cc])

    out = {
        "step": _median_ms(step),
        "layer_matmuls": _median_ms(matmuls),
        "output_projection": _median_ms(lambda: mx.eval(fam.project(bb, hid))),
        "attention_over_cache": _median_ms(attention),
        "filter_one_row": _median_ms(drop_one_row, 3),
    }
    out["rest"] = out["step"] - out["layer_matmuls"] - out["output_projection"] - out["attention_over_cache"]
    return {k: round(v, 1) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", help="jsonl with a 'prompt' per line")
    ap.add_argument("--profile", action="store_true", help="time the parts of one decode step")
    ap.add_argument("--cache-len", type=int, default=256, help="--profile: cached tokens")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--limit", type=int, default=0, help="first N prompts (0: all)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--heads", type=int, default=4, help="targets per position (K)")
    ap.add_argument(
        "--no-distill",
        action="store_true",
        help="keep the jsonl's completions: the teacher-forced path (one prefill per sequence)",
    )
    args = ap.parse_args()

    from mlx_stream.distributed import connect
    from mlx_stream.heads import backbone_fingerprint
    from mlx_stream.loader import load
    from mlx_stream.prompts import prompt_ids
    from mlx_stream.train.pipeline import build_split

    if args.profile:
        model, _ = load(args.model, heads=None)
        ms = profile_step(model, args.batch_size, args.cache_len)
        gflop = args.batch_size * 2 * sum(layer_params(layer) for layer in model.backbone.layers) / 1e9
        print(
            json.dumps(
                {
                    "batch_size": args.batch_size,
                    "cache_len": args.cache_len,
                    "ms": ms,
                    "layer_matmul_gflops": round(gflop / ms["layer_matmuls"] * 1e3, 1),
                    "matmul_gflops_one_thread": round(matmul_gflops(), 1),
                }
            )
        )
        return
    if not args.prompts:
        ap.error("--prompts is required (or --profile)")
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    keep = args.no_distill
    rows = [{"prompt": r["prompt"], "completion": r["completion"] if keep else None} for r in rows]
    rows = rows[: args.limit or None]
    ranks = connect()  # under mlx.launch: the prompts are split over the ranks
    model, tokenizer = load(args.model, heads=None)
    fp = backbone_fingerprint(model.backbone, tokenizer)
    mm_before = matmul_gflops()
    extra = {"top_k": args.top_k} if args.top_k else {}
    with tempfile.TemporaryDirectory() as own:
        tmp = ranks.broadcast_object(own)  # one folder for all the ranks (one machine)
        ranks.barrier()
        tic = time.perf_counter()
        feats = build_split(
            model,
            tokenizer,
            rows,
            Path(tmp),
            "train",
            args.heads,
            not keep,
            args.max_tokens,
            args.batch_size,
            fp,
            ranks=ranks,
            writer=ranks.is_main,
            **extra,
        )
        wall = time.perf_counter() - tic
        positions = len(feats)
        ranks.barrier()  # rank 0's folder stays until every rank has loaded the features
    if not ranks.is_main:
        return
    mm_after = matmul_gflops()
    prompt_tokens = sum(len(prompt_ids(tokenizer, r["prompt"])) for r in rows)
    params = sum(layer_params(layer) for layer in model.backbone.layers)
    flops_per_token = 2 * (params + model.args.vocab_size * model.state_size)
    print(
        json.dumps(
            {
                "prompts": len(rows),
                "path": "teacher-forced" if keep else "self-distillation",
                "ranks": ranks.size,
                "batch_size": args.batch_size,
                "max_tokens": args.max_tokens,
                "top_k": args.top_k,
                "positions": positions,
                "prompt_tokens": prompt_tokens,
                "wall_s": round(wall, 1),
                "positions_per_s": round(positions / wall, 1),
                "achieved_gflops": round((positions + prompt_tokens) * flops_per_token / wall / 1e9, 1),
                "gflop_per_token": round(flops_per_token / 1e9, 3),
                "matmul_gflops_one_thread": [round(mm_before, 1), round(mm_after, 1)],
            }
        )
    )


def layer_params(layer) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(layer.parameters()))


if __name__ == "__main__":
    main()
