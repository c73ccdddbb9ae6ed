"""The decode loop alone: host work per step where a forward pass is nearly free.

On Metal a forward of a small model takes a few milliseconds, so the loop's host work per
step (Python, building the MLX graph, syncs, tree and cache bookkeeping, detokenising)
decides how much of tau reaches the user. This CPU's forward of the default model (~70 ms)
hides that share; this benchmark shows it, with tiny random llama models whose forward is
nearly free (``tests/conftest.make_tiny_model_dir``: "tiny", 2 layers, d = 64, ~0.1 M
parameters; "small", 4 layers, d = 256, ~1.3 M, to see the trend), against plain
``mlx_lm.stream_generate`` on the same weights in one process.

Each configuration decodes the same prompt; the runs of all configurations alternate
(round-robin), ``--reps`` times, and medians are reported: tokens/s after the first token
relative to plain mlx-lm's (the draft-model rows also relative to mlx-lm's own draft-model
decoding with the same draft and K), tau, time to first token (TTFT, from the call to the
first response), and whether the tokens equal plain mlx-lm's (greedy rows). Configurations:

* ``plain``: ``heads=None``, ``adaptive=False``;
* ``oracle chain-3`` / ``oracle tree-8``: an :class:`~mlx_stream.drafters.oracle.OracleDrafter`
  proposing the target's own greedy continuation (tau 4: the ceiling is 4x), a chain of 3
  and an 8-node tree of depth 3;
* ``draft chain-3``: a draft model with the target's weights (a second copy: tau 4),
  ``num_draft_tokens=3``, prompt lookup off, against ``mlx_lm.stream_generate(...,
  draft_model=..., num_draft_tokens=3)``; ``useless draft``: a draft model of other
  random weights (nothing accepted), adaptive speculation on (the default);
* ``heads static`` / ``heads dynamic``: random stream heads (3, residual) on a sparse
  tree, and random EAGLE heads on ``dynamic:8``; ``heads 2-node, adaptive``: the random
  heads on the shipped heads' tree (``0``) with adaptive speculation on (the default);
* ``eagle-3 random, adaptive`` / ``dflash random, adaptive``: random drafters in the published
  EAGLE-3 and DFlash shapes (:func:`published_heads`) on their default trees, adaptive
  speculation on: nothing is accepted, so it turns drafting off, and the drafter's cost on
  the steps left plain shows.

Then one instrumented pass per configuration splits a step's host time into phases
(exclusive wall time of the functions that do each; the instrumentation costs ~1 us a
call): graph building (the forward's and the verdict's ops recorded), submit
(``mx.async_eval``), sync wait (``mx.eval`` in the step's read-back: the device's work the
host waits for), verify bookkeeping (the accepted path walked), cache compaction,
drafter (proposing), policy (adaptive speculation and the drafter learning), emitter
(stop conditions, detokenising), response objects, and the rest of the generator.

Usage (OpenBLAS preloaded, one thread, on a quiet machine)::

    python benchmarks/host_overhead.py [--reps 7] [--max-tokens 200] [--models tiny,small]
        [--temps 0,0.7] [--only plain,oracle] [--no-phases] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import TEXT, make_tiny_model_dir  # noqa: E402

MODELS = {"tiny": {}, "small": {"hidden": 256, "layers": 4}}
PROMPT = TEXT[:160]


def _mlx_lm_run(backbone, tok, ids, max_tokens, temp, draft=None, k=None):
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    kw = {"sampler": make_sampler(temp)} if temp > 0 else {}
    if draft is not None:
        kw |= {"draft_model": draft, "num_draft_tokens": k}
    mx.random.seed(0)
    toks, t0, first = [], time.perf_counter(), None
    for r in mlx_lm.stream_generate(backbone, tok, ids, max_tokens=max_tokens, **kw):
        if first is None:
            first = time.perf_counter()
        toks.append(r.token)
    end = time.perf_counter()
    return {"tokens": toks, "ttft": first - t0, "tps": (len(toks) - 1) / (end - first), "tau": None}


def _ours_run(model, tok, ids, max_tokens, temp, **kw):
    from mlx_stream import stream_generate

    toks, t0, first, last = [], time.perf_counter(), None, None
    for r in stream_generate(model, tok, ids, max_tokens=max_tokens, temp=temp, seed=0, **kw):
        if first is None:
            first = time.perf_counter()
        toks.extend(r.tokens)
        last = r
    end = time.perf_counter()
    return {"tokens": toks, "ttft": first - t0, "tps": (len(toks) - 1) / (end - first), "tau": last.tau}


def _useless(path: Path) -> Path:
    # a random tied model's greedy output repeats its input token, as the target's does, so
    # its drafts would be accepted: an untied random output projection drafts other tokens
    cfg = json.loads((path / "config.json").read_text())
    weights = mx.load(str(path / "model.safetensors"))
    mx.random.seed(1)
    weights["lm_head.weight"] = mx.random.normal(weights["model.embed_tokens.weight"].shape)
    (path / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": False}))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def build(root: Path, name: str):
    """The target, a draft with its weights, a useless draft, random heads; the prompt ids."""
    from mlx_stream import load, load_draft
    from mlx_stream.heads import new_heads

    spec = MODELS[name]
    target_dir = make_tiny_model_dir(root / name / "target", seed=0, **spec)
    same_dir = make_tiny_model_dir(root / name / "same", seed=0, **spec)
    other_dir = _useless(make_tiny_model_dir(root / name / "other", seed=7, **spec))
    model, tok = load(str(target_dir), heads=None, dtype="float32")
    same = load_draft(str(same_dir), model, tok, dtype="float32", calibrate=False)
    other = load_draft(str(other_dir), model, tok, dtype="float32", calibrate=False)
    heads = new_heads(model.backbone, tok, 3, scale=0.02, seed=0)
    eagle = new_heads(model.backbone, tok, 3, architecture="eagle", scale=0.02, seed=0)
    ids = tok.encode(PROMPT)
    return model, tok, same, other, heads, eagle, published_heads(model), ids


def published_heads(model) -> dict:
    """Random drafters in the published formats' shapes (EAGLE-3: one llama layer over the
    inputs of every target layer, its own head; DFlash: one qwen3 layer, a block of 16), as
    their loaders make them: tau ~1, so adaptive speculation turns their drafting off."""
    from mlx_stream.heads import HeadConfig, StreamHeads

    a, n = model.args, len(model.backbone.layers)
    H, V = a.hidden_size, a.vocab_size
    args = {
        "hidden_size": H,
        "num_hidden_layers": 1,
        "intermediate_size": 2 * H,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": H // a.num_attention_heads,
        "vocab_size": V,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e4,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    mx.random.seed(0)
    common = {"hidden_size": H, "vocab_size": V, "fuse_layers": list(range(n))}
    eagle3 = HeadConfig(
        num_heads=6,
        architecture="eagle",
        tree="dynamic:16,4",
        layer_spec={"model_type": "llama", "args": args | {"model_type": "llama"}},
        eagle3={"target_hidden_size": H},
        **common,
    )
    dflash = HeadConfig(
        num_heads=15,
        architecture="dflash",
        tree="chain:15",
        layer_spec={"model_type": "qwen3", "args": args | {"model_type": "qwen3"}},
        dflash={"block_size": 16, "mask_token_id": 0, "target_hidden_size": H, "layers": 1, "head": 0},
        **common,
    )
    out = {"eagle-3": StreamHeads(eagle3), "dflash": StreamHeads(dflash)}
    mx.eval([h.parameters() for h in out.values()])
    return out


def configurations(model, tok, same, other, heads, eagle, published, ids, max_tokens, temp):
    """``{label: (run() -> result, baseline label)}``: ours and mlx-lm's."""
    from mlx_stream.drafters import OracleDrafter
    from mlx_stream.tree import build_tree, chain

    backbone = model.backbone
    ref = _mlx_lm_run(backbone, tok, ids, max_tokens, 0.0)["tokens"]  # the oracle's continuation
    V = model.args.vocab_size
    tree8 = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    oracle3 = OracleDrafter(len(ids), ref, chain(3), V)
    oracle8 = OracleDrafter(len(ids), ref, tree8, V)
    plain = {"adaptive": False, "prompt_lookup": 0}

    def ours(**kw):
        def run():
            model.heads = None
            return _ours_run(model, tok, ids, max_tokens, temp, **kw)

        return run

    def with_heads(h, **kw):
        def run():
            model.heads = h
            try:
                return _ours_run(model, tok, ids, max_tokens, temp, **kw)
            finally:
                model.heads = None

        return run

    return {
        "mlx-lm plain": (lambda: _mlx_lm_run(backbone, tok, ids, max_tokens, temp), None),
        "plain": (ours(**plain), "mlx-lm plain"),
        "oracle chain-3": (ours(drafter=oracle3, adaptive=False), "mlx-lm plain"),
        "oracle tree-8": (ours(drafter=oracle8, adaptive=False), "mlx-lm plain"),
        "mlx-lm draft chain-3": (
            lambda: _mlx_lm_run(backbone, tok, ids, max_tokens, temp, same.backbone, 3),
            "mlx-lm plain",
        ),
        "draft chain-3": (
            ours(draft_model=same, num_draft_tokens=3, prompt_lookup=0),
            "mlx-lm draft chain-3",
        ),
        "useless draft, adaptive": (ours(draft_model=other, prompt_lookup=0), "mlx-lm plain"),
        "heads static": (
            with_heads(heads, tree="0;1;0,0;0,0,0", adaptive=False, prompt_lookup=0),
            "mlx-lm plain",
        ),
        "heads dynamic": (
            with_heads(eagle, tree="dynamic:8", adaptive=False, prompt_lookup=0),
            "mlx-lm plain",
        ),
        "heads 2-node, adaptive": (with_heads(heads, tree="0", prompt_lookup=0), "mlx-lm plain"),
        "eagle-3 random, adaptive": (with_heads(published["eagle-3"], prompt_lookup=0), "mlx-lm plain"),
        "dflash random, adaptive": (with_heads(published["dflash"], prompt_lookup=0), "mlx-lm plain"),
    }


class Phases:
    """Exclusive wall time of the loop's functions, patched in for one run (``with``)."""

    def __init__(self):
        import mlx_stream.steps as s

        g = sys.modules["mlx_stream.generate"]  # (the package's `generate` is the function)

        self.seconds = defaultdict(float)
        self._stack = [0.0]
        self.targets = [
            (s.StepPipeline, "launch", "graph building"),
            (s.StepPipeline, "finish", "verify bookkeeping"),
            (s.StepPipeline, "start", "drafter"),
            (s.StepPipeline, "queue_after", "drafter"),
            (s.StepPipeline, "observe", "policy"),
            (s.TreeVerifier, "walk", "verify bookkeeping"),
            (s, "keep_path", "cache compaction"),
            (s, "propose", "drafter"),
            (g._Emitter, "push", "emitter"),
            (g, "_response", "response objects"),
            (mx, "eval", "sync wait"),
            (mx, "async_eval", "submit"),
            (g, "prefill", "prefill"),
            (g, "_first_step", "prefill"),
        ]
        self._saved = []

    def _wrap(self, fn, phase):
        def wrapped(*a, **kw):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                inner = self._stack.pop()
                self.seconds[phase] += dt - inner
                self._stack[-1] += dt

        return wrapped

    def __enter__(self):
        for obj, name, phase in self.targets:
            fn = obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)
            self._saved.append((obj, name, fn))
            setattr(obj, name, self._wrap(fn, phase))
        return self

    def __exit__(self, *exc):
        for obj, name, fn in reversed(self._saved):
            setattr(obj, name, fn)
        self._saved = []


def phase_breakdown(run, n_fwd_of) -> dict:
    """Milliseconds per step by phase for one instrumented run."""
    run()  # warm
    with Phases() as p:
        t0 = time.perf_counter()
        res = run()
        total = time.perf_counter() - t0
    steps = max(n_fwd_of(res), 1)
    out = {k: 1e3 * v / steps for k, v in p.seconds.items() if k != "prefill"}
    out["rest of the generator"] = 1e3 * (total - sum(p.seconds.values())) / steps
    out["total per step"] = 1e3 * (total - p.seconds.get("prefill", 0.0)) / steps
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument(
        "--only", default="", help="comma-separated label prefixes to run (mlx-lm rows always run)"
    )
    ap.add_argument("--no-phases", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("BEFORE", "AFTER"),
        help="print two --json runs side by side",
    )
    args = ap.parse_args(argv)
    if args.compare:
        compare(*(json.loads(p.read_text()) for p in args.compare))
        return

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            built = build(Path(tmp), name)
            model = built[0]
            for temp in [float(t) for t in args.temps.split(",")]:
                confs = configurations(*built, args.max_tokens, temp)
                if args.only:
                    keep = tuple(args.only.split(","))
                    confs = {k: v for k, v in confs.items() if k.startswith("mlx-lm") or k.startswith(keep)}
                runs = defaultdict(list)
                for fn, _ in confs.values():  # warm every path once
                    fn()
                for _ in range(args.reps):
                    for label, (fn, _) in confs.items():
                        runs[label].append(fn())
                ref = runs["mlx-lm plain"][0]["tokens"]
                table = {}
                for label, (_fn, base) in confs.items():
                    rs = runs[label]
                    row = {
                        "tok/s": statistics.median(r["tps"] for r in rs),
                        "ttft ms": 1e3 * statistics.median(r["ttft"] for r in rs),
                        "tau": rs[0]["tau"],
                        "tokens": len(rs[0]["tokens"]),
                    }
                    if base is not None:
                        row["x base"] = statistics.median(r["tps"] / b["tps"] for r, b in zip(rs, runs[base]))
                        row["base"] = base
                    if base == "mlx-lm draft chain-3":
                        row["x plain mlx-lm"] = statistics.median(
                            r["tps"] / b["tps"] for r, b in zip(rs, runs["mlx-lm plain"])
                        )
                    if temp == 0:
                        row["identical"] = all(r["tokens"] == ref for r in rs)
                    table[label] = row
                if not args.no_phases:
                    for label, (fn, _) in confs.items():
                        if not label.startswith("mlx-lm"):
                            tau = table[label]["tau"] or 1.0
                            table[label]["phases ms/step"] = phase_breakdown(
                                fn, lambda r, tau=tau: round((len(r["tokens"]) - 1) / tau)
                            )
                results[f"{name} T={temp:g}"] = table
                _print(name, temp, table, model)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def compare(before: dict, after: dict) -> None:
    """Two runs side by side: speed relative to the baseline, tau, TTFT; then ms per step by phase."""
    for key in after:
        if key not in before:
            continue
        b, a = before[key], after[key]
        print(f"\n### {key}\n")
        print("| decoding | before: x baseline | after: x baseline | tau | TTFT ms before / after |")
        print("|---|---|---|---|---|")
        for label, row in a.items():
            if label not in b or "x base" not in row:
                continue
            base = row["base"].replace("mlx-lm ", "mlx-lm's ")
            tau = "" if row["tau"] is None else f"{row['tau']:.2f}"
            print(
                f"| {label} | {b[label]['x base']:.2f}x | **{row['x base']:.2f}x** of {base} | {tau} "
                f"| {b[label]['ttft ms']:.1f} / {row['ttft ms']:.1f} |"
            )
        bp, ap = b["mlx-lm plain"], a["mlx-lm plain"]
        print(
            f"| mlx-lm plain (tok/s) | {bp['tok/s']:.0f} | {ap['tok/s']:.0f} | | "
            f"{bp['ttft ms']:.1f} / {ap['ttft ms']:.1f} |"
        )
        phased = [k for k in a if "phases ms/step" in a[k] and "phases ms/step" in b.get(k, {})]
        if phased:
            names = sorted(
                {p for k in phased for p in a[k]["phases ms/step"]}, key=lambda p: (p == "total per step", p)
            )
            print("\nms of host time per step, before -> after:\n")
            print("| phase | " + " | ".join(phased) + " |")
            print("|---|" + "---|" * len(phased))
            for p in names:
                cells = [
                    f"{b[k]['phases ms/step'].get(p, 0.0):.2f} -> {a[k]['phases ms/step'].get(p, 0.0):.2f}"
                    for k in phased
                ]
                print(f"| {p} | " + " | ".join(cells) + " |")


def _print(name, temp, table, model):
    base = table["mlx-lm plain"]
    print(
        f"\n## {name} model, T = {temp:g}: plain mlx-lm {base['tok/s']:.0f} tok/s "
        f"({1e3 / base['tok/s']:.2f} ms/token), TTFT {base['ttft ms']:.1f} ms"
    )
    print("| decoding | x baseline (median) | tok/s | tau | TTFT ms | identical |")
    print("|---|---|---|---|---|---|")
    for label, row in table.items():
        x = "" if "x base" not in row else f"{row['x base']:.2f}x of {row['base']}"
        if "x plain mlx-lm" in row:
            x += f" ({row['x plain mlx-lm']:.2f}x of mlx-lm plain)"
        tau = "" if row["tau"] is None else f"{row['tau']:.2f}"
        ident = {True: "yes", False: "NO"}.get(row.get("identical"), "-")
        print(f"| {label} | {x} | {row['tok/s']:.0f} | {tau} | {row['ttft ms']:.1f} | {ident} |")
    phased = {k: v["phases ms/step"] for k, v in table.items() if "phases ms/step" in v}
    if phased:
        names = sorted({p for v in phased.values() for p in v}, key=lambda p: (p == "total per step", p))
        print("\nhost time per step, ms (one instrumented run each):\n")
        print("| phase | " + " | ".join(phased) + " |")
        print("|---|" + "---|" * len(phased))
        for p in names:
            print(f"| {p} | " + " | ".join(f"{v.get(p, 0.0):.3f}" for v in phased.values()) + " |")


if __name__ == "__main__":
    main()
