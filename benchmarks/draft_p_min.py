"""Where a draft model stops drafting (p_min), side by side with mlx-lm's draft-model decoding.

For each prompt, one after the other in one process and with the same weights: plain
``mlx_lm.stream_generate``; mlx-lm's ``stream_generate(..., draft_model=, num_draft_tokens=K)``;
then ours with each ``--p-min`` value, as a chain of K (``num_draft_tokens=K``) and, with
``--tree``, as a tree (``tree="dynamic:N,W"``), adaptive speculation off. Each prompt is cut
to its last ``--prompt-tail`` tokens, so that a slow draft's prefill (both decoders pay it)
does not swamp the decoding. Reported: speed relative to plain in tokens per second of wall
time (prefill included), and tokens per target forward; medians over the prompts.

    python benchmarks/draft_p_min.py --draft /tmp/smol-q3 --p-min 0 0.2 0.4 0.6
    python benchmarks/draft_p_min.py --draft /tmp/smol-q3 --p-min 0 0.6 --tree dynamic:8,2 --limit 4

(run with OpenBLAS preloaded, as `make` does).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from mlx_stream import load, stream_generate
from mlx_stream.prompts import prompt_ids, select_prompts


def _mlx_lm(target, tok, ids, n, sampler, seed, draft=None, k=None):
    mx.random.seed(seed)
    kw = {"draft_model": draft, "num_draft_tokens": k} if draft is not None else {}
    tic, count, from_draft = time.perf_counter(), 0, 0
    for r in mlx_lm.stream_generate(target, tok, mx.array(ids), max_tokens=n, sampler=sampler, **kw):
        count += 1
        from_draft += bool(getattr(r, "from_draft", False))
    return count / (time.perf_counter() - tic), count / max(count - from_draft, 1)


def _ours(model, tok, ids, n, temp, seed, **kw):
    tic, count, last = time.perf_counter(), 0, None
    for last in stream_generate(model, tok, ids, max_tokens=n, temp=temp, seed=seed, adaptive=False, **kw):
        count += len(last.tokens)
    return count / (time.perf_counter() - tic), last.tau


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", required=True, help="the draft model (any form --model takes)")
    ap.add_argument("--prompts", default="spec-bench")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--prompt-tail", type=int, default=120, help="keep each prompt's last N tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=3, help="the chain's length, for mlx-lm and ours")
    ap.add_argument("--p-min", type=float, nargs="+", default=[0.0, 0.2, 0.4, 0.6])
    ap.add_argument("--tree", default=None, help="also our tree dynamic:N,W at each p_min")
    a = ap.parse_args()

    model, tok = load(a.model, heads="none", dtype="float32", draft_model=a.draft)
    target, draft = model.backbone, model.draft_model.backbone
    texts, _ = select_prompts(a.prompts, a.limit, a.per_category)
    sampler = make_sampler(temp=a.temp) if a.temp > 0 else None
    ours = [(f"chain K={a.k} p_min {p}", p, {"num_draft_tokens": a.k}) for p in a.p_min]
    ours += [(f"tree {a.tree} p_min {p}", p, {"tree": a.tree}) for p in a.p_min if a.tree]
    warm = prompt_ids(tok, "Hello")  # one-time costs hit no measurement
    _mlx_lm(target, tok, warm, 8, sampler, 0, draft, a.k)
    for _, p, kw in ours:
        model.draft_model.p_min = p
        _ours(model, tok, warm, 8, a.temp, 0, **kw)
    rows = []
    for i, text in enumerate(texts):
        ids = prompt_ids(tok, text)[-a.prompt_tail :]
        plain, _ = _mlx_lm(target, tok, ids, a.max_tokens, None, i)
        row = {f"mlx-lm K={a.k}": _mlx_lm(target, tok, ids, a.max_tokens, sampler, i, draft, a.k)}
        for name, p, kw in ours:
            model.draft_model.p_min = p
            row[name] = _ours(model, tok, ids, a.max_tokens, a.temp, i, **kw)
        row = {n: (tps / plain, tau) for n, (tps, tau) in row.items()}
        print(
            f"prompt {i} ({len(ids)} tokens): "
            + "  ".join(f"{n}: x{s:.2f} tau {t:.2f}" for n, (s, t) in row.items())
        )
        rows.append(row)
    print(f"\n{len(rows)} prompts, {a.max_tokens} tokens, temp {a.temp}, draft {a.draft}; medians:")
    for name in rows[0]:
        speed = statistics.median(r[name][0] for r in rows)
        tau = statistics.median(r[name][1] for r in rows)
        print(f"{name:28s} x{speed:.2f}  tau {tau:.2f}")


if __name__ == "__main__":
    main()
