"""A separate draft model, side by side with mlx-lm's own draft-model decoding.

For each prompt, one after the other in one process and with the same weights (the
target in float32, the draft as stored): plain ``mlx_lm.stream_generate``; mlx-lm's
``stream_generate(..., draft_model=, num_draft_tokens=K)`` for each K; and
``mlx_stream.stream_generate(..., draft_model=)`` as it ships (the depth calibrated on
this device, adaptive speculation on), and with adaptive speculation off, a tree
(``--trees``) and a chain of each K, so that tokens per target forward compare the
drafting itself. Reported per configuration: the median speed relative to plain
mlx-lm, and tokens per target forward (for mlx-lm: tokens emitted / tokens not from
the draft, one per verifying forward). Greedy output must equal plain mlx-lm's.

    python benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --per-category 8 --max-tokens 128
    python benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --per-category 8 --temp 0.7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from mlx_stream import load, stream_generate
from mlx_stream.prompts import prompt_ids, select_prompts


def _mlx_lm(target, tok, ids, max_tokens, sampler, seed, draft=None, k=None):
    mx.random.seed(seed)
    kw = {"draft_model": draft, "num_draft_tokens": k} if draft is not None else {}
    out, from_draft, tps = [], 0, 0.0
    for r in mlx_lm.stream_generate(target, tok, mx.array(ids), max_tokens=max_tokens, sampler=sampler, **kw):
        if r.token in tok.eos_token_ids:
            break
        out.append(r.token)
        from_draft += bool(getattr(r, "from_draft", False))
        tps = r.generation_tps
    return out, tps, len(out) / max(len(out) - from_draft, 1)


def _ours(model, tok, ids, max_tokens, temp, seed, **kw):
    out, last = [], None
    for last in stream_generate(model, tok, ids, max_tokens=max_tokens, temp=temp, seed=seed, **kw):
        out.extend(last.tokens)
    return out, last.generation_tps, last.tau


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", required=True, help="the draft model (any form --model takes)")
    ap.add_argument("--prompts", default="spec-bench")
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3])
    ap.add_argument(
        "--trees", nargs="*", default=["dynamic:8,2"], help="our trees (adaptive off): dynamic:N,W"
    )
    ap.add_argument("--prompt-lookup", type=int, default=0, help="ours: prompt lookup beside the draft")
    ap.add_argument("--p-min", type=float, default=None, help="ours: where drafting stops (default: P_MIN)")
    ap.add_argument("--out", default=None, help="write the per-prompt rows and the summary as JSON")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="with --out: keep the prompts an earlier run with the same arguments wrote",
    )
    a = ap.parse_args()

    model, tok = load(a.model, heads="none", dtype="float32", draft_model=a.draft, draft_p_min=a.p_min)
    target, draft = model.backbone, model.draft_model.backbone
    texts, _ = select_prompts(a.prompts, a.limit, a.per_category)
    sampler = make_sampler(temp=a.temp) if a.temp > 0 else None
    configs = (
        [("mlx-lm plain", {})]
        + [(f"mlx-lm draft K={k}", {"k": k}) for k in a.k]
        + [("mlx-stream as shipped", {})]
        + [(f"mlx-stream tree {t}", {"tree": t, "adaptive": False}) for t in a.trees]
        + [(f"mlx-stream chain K={k}", {"num_draft_tokens": k, "adaptive": False}) for k in a.k]
    )
    warm = prompt_ids(tok, "Hello")
    for name, c in configs:  # one-time costs hit no measurement
        if name.startswith("mlx-lm"):
            _mlx_lm(target, tok, warm, 8, sampler, 0, draft if "k" in c else None, c.get("k"))
        else:
            _ours(model, tok, warm, 8, a.temp, 0, prompt_lookup=a.prompt_lookup, **c)
    rows = []
    if a.out and a.resume and os.path.exists(a.out):  # a run stopped part way: keep its prompts
        with open(a.out) as f:
            old = json.load(f)
        if old["args"] | {"resume": a.resume} == vars(a):
            rows = old["rows"]
            print(f"resuming after {len(rows)} prompts of {a.out}", flush=True)
    tic = time.perf_counter()
    for i, text in enumerate(texts):
        if i < len(rows):
            continue
        ids = prompt_ids(tok, text)
        row, ref = {"prompt": i}, None
        for name, c in configs:
            if name.startswith("mlx-lm"):
                out, tps, tau = _mlx_lm(
                    target, tok, ids, a.max_tokens, sampler, i, draft if "k" in c else None, c.get("k")
                )
            else:
                out, tps, tau = _ours(
                    model, tok, ids, a.max_tokens, a.temp, i, prompt_lookup=a.prompt_lookup, **c
                )
            ref = out if ref is None else ref
            row[name] = {"tps": tps, "tau": tau, "tokens": len(out), "identical": out == ref}
        plain = row["mlx-lm plain"]["tps"]
        print(
            f"prompt {i:2d}: "
            + "  ".join(
                f"{n}: x{r['tps'] / plain:.2f} tau {r['tau']:.2f}" for n, r in row.items() if n != "prompt"
            ),
            flush=True,
        )
        rows.append(row)
        if a.out:  # after every prompt, atomically: a stopped run loses one prompt at most
            _write(a.out, {"args": vars(a), "summary": None, "rows": rows})
    summary = {}
    for name, _ in configs:
        summary[name] = {
            "median_speedup": statistics.median(r[name]["tps"] / r["mlx-lm plain"]["tps"] for r in rows),
            "median_tau": statistics.median(r[name]["tau"] for r in rows),
            "identical": sum(r[name]["identical"] for r in rows),
        }
    print(
        f"\n{len(rows)} prompts, {a.max_tokens} tokens, temp {a.temp}, draft {a.draft} "
        f"({time.perf_counter() - tic:.0f} s)"
    )
    for name, s in summary.items():
        same = f"  identical {s['identical']}/{len(rows)}" if a.temp == 0 else ""
        print(f"{name:24s} x{s['median_speedup']:.2f}  tau {s['median_tau']:.2f}{same}")
    if a.out:
        _write(a.out, {"args": vars(a), "summary": summary, "rows": rows})


def _write(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
