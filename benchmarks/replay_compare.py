"""Spec-Bench tau of several heads and trees over one greedy generation (replay).

The backbone's greedy outputs (and hidden states) for the chosen Spec-Bench first turns
are made once, batched; then every (heads, tree) pair is replayed over them with the
decode loop's own drafters (heads, tree, prompt lookup and its gate;
``mlx_stream.train.replay``), which gives the loop's tau per prompt (checked against
the loop in tests/test_real_identity.py and tests/test_eagle.py).

    python benchmarks/replay_compare.py --heads default,runs/a1/heads --trees "0 0;0,0" --per-group 16

(run with OpenBLAS preloaded, as `make` does). Prints one markdown table (tau overall
and per task group) and writes the numbers as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import time
from pathlib import Path

from mlx_stream.bench import pool_tau
from mlx_stream.files import atomic_write
from mlx_stream.heads import backbone_fingerprint, load_heads
from mlx_stream.loader import load, resolve_heads
from mlx_stream.prompts import load_spec_bench
from mlx_stream.train.replay import fused_states, greedy_outputs, replay_outputs


def make_store(spec: str, tok, fp):
    """``f(heads_folder) -> DraftStore or False`` for a --stores entry."""
    from mlx_stream.datastore import STORE_FILE, Datastore, DraftStore, load_store
    from mlx_stream.prompts import read_jsonl

    parts = spec.split("+")
    if parts == ["none"]:
        return lambda folder: False
    seqs = [
        tok.encode(r["completion"], add_special_tokens=False)
        for f in parts
        if f != "heads"
        for r in read_jsonl(f)
        if r.get("completion")
    ]
    extra = Datastore.from_sequences(seqs) if seqs else None

    def make(folder):
        shipped = load_store(Path(folder) / STORE_FILE, fp["tokenizer"]) if "heads" in parts else None
        store = DraftStore(shipped, learn=False, more=[extra] if extra is not None else [])
        print(f"datastore {spec}: {len(store)} tokens", flush=True)
        return store

    return make


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--heads", default="default", help="comma-separated heads folders ('default': shipped)")
    ap.add_argument("--trees", default="", help="space-separated trees ('' or 'stored': each heads' own)")
    ap.add_argument(
        "--per-group", type=int, default=None, help="first N of each task group (all 480 if unset)"
    )
    ap.add_argument(
        "--questions",
        default=None,
        help="a Spec-Bench-style question.jsonl ({category, turns}); default: the shipped Spec-Bench",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-lookup", type=int, default=None, help="None: the default (10 with heads)")
    ap.add_argument(
        "--stores",
        default="none",
        help="space-separated datastores to replay with: 'none'; 'heads' (the heads folder's "
        "datastore.npz); jsonl files of {prompt, completion} (their completions); joined with '+', "
        "e.g. 'none heads heads+runs/b/data/train.jsonl'",
    )
    ap.add_argument(
        "--outputs",
        default=None,
        help="a .pkl of the greedy outputs: read if it exists (same prompts and --max-tokens), else written",
    )
    ap.add_argument("--only-outputs", action="store_true", help="make (and save) the outputs, replay nothing")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    model, tok = load(a.model, heads=None, dtype="float32")
    fp = backbone_fingerprint(model.backbone, tok)
    heads = {h: load_heads(resolve_heads(a.model, h), fingerprint=fp) for h in a.heads.split(",")}
    trees = a.trees.split() if a.trees else ["stored"]
    items = load_spec_bench(a.questions, a.per_group)
    tic = time.perf_counter()
    eagle = any(h.autoregressive for h in heads.values())
    key = {"prompts": [it["prompt"] for it in items], "max_tokens": a.max_tokens}
    saved = None
    if a.outputs and Path(a.outputs).is_file():
        with open(a.outputs, "rb") as f:
            saved = pickle.load(f)
        if saved["key"] != key:
            raise SystemExit(f"{a.outputs}: made for other prompts or --max-tokens")
        outputs = saved["outputs"]
    else:
        outputs = greedy_outputs(model, tok, items, a.max_tokens, prompt_states=eagle or a.only_outputs)
        if a.outputs:
            atomic_write(a.outputs, lambda p: p.write_bytes(pickle.dumps({"key": key, "outputs": outputs})))
    print(f"greedy outputs of {len(items)} prompts in {time.perf_counter() - tic:.0f}s", flush=True)
    if a.only_outputs:
        return
    stores = {spec: make_store(spec, tok, fp) for spec in a.stores.split()}
    results, states = {}, {}
    for (name, h), tree, (sname, make) in itertools.product(heads.items(), trees, stores.items()):
        model.heads = h
        fuse = tuple(h.config.fuse_layers)
        if h.autoregressive and fuse not in states:  # eagle heads: every position's (fused) features
            states[fuse] = fused_states(model, outputs, fuse)
        tic = time.perf_counter()
        spec = None if tree == "stored" else tree
        store = make(resolve_heads(a.model, name))
        got = states[fuse] if h.autoregressive else outputs
        rows = replay_outputs(model, items, got, a.max_tokens, spec, a.prompt_lookup, store=store)
        res = pool_tau(rows)
        key = f"{name} | {tree if tree != 'stored' else 'stored: ' + (h.config.tree or 'sparse')} | {sname}"
        results[key] = {k: v["tau"] for k, v in res.items() if k == "all" or k.startswith("group:")}
        print(f"{key}: tau {results[key]['all']:.3f} ({time.perf_counter() - tic:.0f}s)", flush=True)
    groups = sorted(k for k in next(iter(results.values())) if k.startswith("group:"))
    print("\n| heads / tree | all | " + " | ".join(g[6:] for g in groups) + " |")
    print("|---|---|" + "---|" * len(groups))
    for key, r in results.items():
        print(f"| {key} | {r['all']:.3f} | " + " | ".join(f"{r[g]:.3f}" for g in groups) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "prompts": len(items), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
