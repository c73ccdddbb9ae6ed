"""A separate draft model, side by side with mlx-lm's own draft-model decoding.

For each prompt, one after the other in one process and with the same weights (the
target in float32, the draft as stored): plain ``mlx_lm.stream_generate``; mlx-lm's
``stream_generate(..., draft_model=, num_draft_tokens=K)`` for each K; and
``mlx_stream.stream_generate(..., draft_model=)`` as it ships (the depth calibrated on
this device, adaptive speculation on), and with adaptive speculation off, a tree
(``--trees``) and a chain of each ``--chains`` K, so that tokens per target forward
compare the drafting itself. Each ``--temp`` runs every configuration on the prompt
before the next prompt. Reported per configuration and temperature: the median speed
relative to plain mlx-lm (decode tokens/s, prefill excluded, both timed by one stopwatch:
:func:`mlx_stream.bench.timed_tokens`),
and tokens per target forward (for mlx-lm: tokens emitted / tokens not from the draft,
one per verifying forward). Greedy output must equal plain mlx-lm's.

The prompt (all but its last token) is prefilled once per prompt into both models' KV
caches, and every configuration starts from a copy of them: the speed measured excludes
prefill anyway, and a 3-bit draft's prefill on a CPU (~0.1 s a token) would otherwise
take most of the run. Prompts run category by category in turn (the first of each, then
the second, ...); ``--shard I/N`` runs every N-th of them from the I-th, so that N
processes share the prompts (each still side by side within itself), and ``--reverse``
runs a shard's prompts last first, so that a second process on the same shard meets the
first; ``--summarize`` merges their ``--out`` files (a prompt run twice counts once).

    python benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --per-category 8 --max-tokens 128
    python benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --temp 0 0.7 --shard 0/2 --out a.json --resume
    python benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --k 2 --trees dynamic:16,4,2@0 dynamic:16,4
    python benchmarks/draft_vs_mlx_lm.py --summarize a.json b.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from mlx_stream import PromptCache, load, stream_generate
from mlx_stream.bench import timed_tokens
from mlx_stream.cache import TreeKVCache
from mlx_stream.drafters.draft_model import DraftCache
from mlx_stream.prompts import prompt_ids, select_prompts


def _prefill(backbone, ids):
    cache = make_prompt_cache(backbone)
    for i in range(0, len(ids), 512):
        backbone(mx.array([ids[i : i + 512]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def _copy(caches, cls):
    out = []
    for c in caches:
        new = cls()
        if c.offset:  # a copy of exactly the valid entries: the first write grows a new buffer
            new.keys, new.values = (
                mx.array(c.keys[..., : c.offset, :]),
                mx.array(c.values[..., : c.offset, :]),
            )
            new.offset = c.offset
        out.append(new)
    mx.eval([c.state for c in out if c.offset])
    return out


def _mlx_lm(target, tok, ids, max_tokens, sampler, seed, cache, draft=None, k=None):
    mx.random.seed(seed)
    kw = {"draft_model": draft, "num_draft_tokens": k} if draft is not None else {}
    eos, from_draft = set(tok.eos_token_ids), [0]

    def tokens(r):
        if r.token in eos:
            return []
        from_draft[0] += bool(getattr(r, "from_draft", False))
        return [r.token]

    out, tps, _ = timed_tokens(
        mlx_lm.stream_generate(
            target, tok, mx.array(ids[-1:]), max_tokens=max_tokens, sampler=sampler, prompt_cache=cache, **kw
        ),
        tokens,
    )
    return out, tps, len(out) / max(len(out) - from_draft[0], 1)


def _ours(model, tok, ids, max_tokens, temp, seed, cache=None, **kw):
    out, tps, last = timed_tokens(
        stream_generate(
            model, tok, ids, max_tokens=max_tokens, temp=temp, seed=seed, prompt_cache=cache, **kw
        ),
        lambda r: r.tokens,
    )
    return out, tps, last.tau


def _our_cache(model, ids, target_cache, draft_cache):
    cache = PromptCache(model)
    cache.layers[:] = _copy(target_cache, TreeKVCache)
    cache.tokens = list(ids[:-1])
    if draft_cache is None:  # the drafter will not read it
        return cache
    cache.draft = DraftCache(model.draft_model)
    cache.draft.layers = _copy(draft_cache, TreeKVCache)
    cache.draft.tokens = list(ids[:-1])
    return cache


def _tree_config(spec: str) -> dict:
    tree, _, p = spec.partition("@")
    return {"tree": tree, "adaptive": False} | ({"p_min": float(p)} if p else {})


def summarize(rows: list[dict]) -> dict:
    """Medians per temperature and configuration over ``rows`` (one per prompt and temperature)."""
    summary = {}
    for temp in sorted({r["temp"] for r in rows}):
        at = [r for r in rows if r["temp"] == temp]
        names = [n for n in at[0] if n not in ("prompt", "temp")]
        summary[str(temp)] = {
            name: {
                "prompts": len(at),
                "median_speedup": statistics.median(r[name]["tps"] / r["mlx-lm plain"]["tps"] for r in at),
                "median_tau": statistics.median(r[name]["tau"] for r in at),
                "identical": sum(r[name]["identical"] for r in at),
            }
            for name in names
        }
    return summary


def _print_summary(summary: dict, note: str) -> None:
    for temp, configs in summary.items():
        n = next(iter(configs.values()))["prompts"]
        print(f"\n{n} prompts, temp {temp}{note}; medians:")
        for name, s in configs.items():
            same = f"  identical {s['identical']}/{n}" if float(temp) == 0 else ""
            print(f"{name:28s} x{s['median_speedup']:.2f}  tau {s['median_tau']:.2f}{same}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", help="the draft model (any form --model takes)")
    ap.add_argument("--prompts", default="spec-bench")
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temp", type=float, nargs="+", default=[0.0], help="each prompt at each temperature")
    ap.add_argument("--k", type=int, nargs="*", default=[2, 3], help="mlx-lm's num_draft_tokens")
    ap.add_argument("--chains", type=int, nargs="*", default=None, help="our chains (default: --k)")
    ap.add_argument(
        "--trees",
        nargs="*",
        default=["dynamic:16,4"],
        help="our trees (adaptive off): dynamic:N,W[,D], each optionally @P: drafting stops below p_min P",
    )
    ap.add_argument("--prompt-lookup", type=int, default=0, help="ours: prompt lookup beside the draft")
    ap.add_argument("--p-min", type=float, default=None, help="ours: where drafting stops (default: P_MIN)")
    ap.add_argument("--shard", default="0/1", help="I/N: every N-th prompt from the I-th")
    ap.add_argument(
        "--reverse",
        action="store_true",
        help="the shard's prompts last first (a second process meets the first)",
    )
    ap.add_argument("--out", default=None, help="write the per-prompt rows and the summary as JSON")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="with --out: keep the prompts an earlier run with the same arguments wrote",
    )
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="merge --out files and print medians")
    a = ap.parse_args()
    if a.summarize:
        rows, seen = [], set()
        for path in a.summarize:
            with open(path) as f:
                for r in json.load(f)["rows"]:  # a prompt two processes both ran counts once
                    if (r["prompt"], r["temp"]) not in seen:
                        seen.add((r["prompt"], r["temp"]))
                        rows.append(r)
        _print_summary(summarize(rows), f" ({len(a.summarize)} files)")
        return
    if not a.draft:
        ap.error("--draft is required (or --summarize)")
    shard, shards = (int(x) for x in a.shard.split("/"))

    model, tok = load(a.model, heads="none", dtype="float32", draft_model=a.draft, draft_p_min=a.p_min)
    target, draft, p_min = model.backbone, model.draft_model.backbone, model.draft_model.p_min
    texts, groups = select_prompts(a.prompts, a.limit, a.per_category)
    # the categories in turn (the first of each, then the second, ...), so that a run stopped
    # part way has measured every category
    order = sorted(range(len(texts)), key=lambda i: (groups[:i].count(groups[i]), i) if groups else i)
    order = order[shard::shards][:: -1 if a.reverse else 1]
    chains = a.k if a.chains is None else a.chains
    configs = (
        [("mlx-lm plain", {})]
        + [(f"mlx-lm draft K={k}", {"k": k}) for k in a.k]
        + [("mlx-stream as shipped", {})]
        + [(f"mlx-stream tree {t}", _tree_config(t)) for t in a.trees]
        + [(f"mlx-stream chain K={k}", {"num_draft_tokens": k, "adaptive": False}) for k in chains]
    )

    def run(name, c, ids, n, temp, seed, target_cache, draft_cache):
        # draft_cache(): the draft's prompt cache, prefilled on first use (a 3-bit draft's
        # prefill is slow here, and a plain or as-shipped-plain configuration needs none)
        if name.startswith("mlx-lm"):
            sampler = make_sampler(temp=temp) if temp > 0 else None
            if "k" in c:
                cache = _copy(target_cache, KVCache) + _copy(draft_cache(), KVCache)
                return _mlx_lm(target, tok, ids, n, sampler, seed, cache, draft, c["k"])
            return _mlx_lm(target, tok, ids, n, sampler, seed, _copy(target_cache, KVCache))
        plain = name == "mlx-stream as shipped" and not model.draft_model.depth  # calibrated not to pay
        cache = _our_cache(model, ids, target_cache, None if plain else draft_cache())
        c = dict(c)
        model.draft_model.p_min = c.pop("p_min", p_min)
        return _ours(model, tok, ids, n, temp, seed, cache, prompt_lookup=a.prompt_lookup, **c)

    warm = prompt_ids(tok, "Hello")  # one-time costs hit no measurement
    warm_caches = _prefill(target, warm[:-1]), functools.cache(lambda: _prefill(draft, warm[:-1]))
    for temp in a.temp:
        for name, c in configs:
            run(name, c, warm, 8, temp, 0, *warm_caches)
    rows = []
    if a.out and a.resume and os.path.exists(a.out):  # a run stopped part way: keep its prompts
        with open(a.out) as f:
            old = json.load(f)
        if old["args"] | {"resume": a.resume} == vars(a):
            rows = old["rows"]
            print(f"resuming after {len(rows)} rows of {a.out}", flush=True)
    done = {(r["prompt"], r["temp"]) for r in rows}
    tic = time.perf_counter()
    for i in order:
        if all((i, t) in done for t in a.temp):
            continue
        ids = prompt_ids(tok, texts[i])
        target_cache = _prefill(target, ids[:-1])
        draft_cache = functools.cache(lambda ids=ids: _prefill(draft, ids[:-1]))
        for temp in a.temp:
            if (i, temp) in done:
                continue
            row, ref = {"prompt": i, "temp": temp}, None
            for name, c in configs:
                out, tps, tau = run(name, c, ids, a.max_tokens, temp, i, target_cache, draft_cache)
                ref = out if ref is None else ref
                row[name] = {"tps": tps, "tau": tau, "tokens": len(out), "identical": out == ref}
            plain = row["mlx-lm plain"]["tps"]
            print(
                f"prompt {i:2d} ({len(ids)} tokens) temp {temp}: "
                + "  ".join(
                    f"{n}: x{r['tps'] / plain:.2f} tau {r['tau']:.2f}"
                    for n, r in row.items()
                    if isinstance(r, dict)
                ),
                flush=True,
            )
            rows.append(row)
            if a.out:  # after every prompt, atomically: a stopped run loses one prompt at most
                _write(a.out, {"args": vars(a), "summary": None, "rows": rows})
    summary = summarize(rows) if rows else {}
    _print_summary(summary, f", {a.max_tokens} tokens, draft {a.draft} ({time.perf_counter() - tic:.0f} s)")
    if a.out:
        _write(a.out, {"args": vars(a), "summary": summary, "rows": rows})


def _write(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
