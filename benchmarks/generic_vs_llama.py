"""The default model through its own module (``models/llama.py``: the attention
re-assembled, the graph queued every two layers on the CPU) against the generic path
every other mlx-lm model takes (``models/generic.Generic``: mlx-lm's own ``__call__``
with tree masks and per-node rotary offsets), side by side in one process.

Each Spec-Bench prompt (the first ``--per-group`` of each task group) is decoded by both
paths in turn, alternating which goes first, greedy, with the shipped heads and the
defaults (adaptive speculation and prompt lookup on) and plainly (``--plain``). Reports
tokens/s medians, their ratio, tau and whether the two outputs are identical.

    python benchmarks/generic_vs_llama.py [--per-group 2] [--max-tokens 128] [--plain]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlx_stream import load, stream_generate
from mlx_stream.models import family
from mlx_stream.models.generic import Generic
from mlx_stream.prompts import load_spec_bench, prompt_ids


def run(model, tok, ids, max_tokens, plain):
    kw = {"prompt_lookup": 0, "adaptive": False} if plain else {}
    out, start, last = [], None, None
    for r in stream_generate(model, tok, ids, max_tokens=max_tokens, **kw):
        if start is None:
            start = time.perf_counter()
        out += r.tokens
        last = r
    return out, (len(out) - 1) / (time.perf_counter() - start), last.tau


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--plain", action="store_true", help="no drafting (heads=None, lookup off)")
    args = ap.parse_args()
    model, tok = load("smollm2-135m-instruct", heads=None if args.plain else "default")
    paths = {"llama.py": family(model.backbone), "generic": Generic(model.backbone)}
    assert paths["generic"].trees is None, paths["generic"].trees
    tps = {k: [] for k in paths}
    taus = {k: [] for k in paths}
    same = 0
    items = list(load_spec_bench(per_group=args.per_group))
    for i, it in enumerate(items):
        ids = prompt_ids(tok, it["prompt"])
        outs = {}
        for name in sorted(paths, reverse=bool(i % 2)):  # alternate which goes first
            model.family = paths[name]
            outs[name], t, tau = run(model, tok, ids, args.max_tokens, args.plain)
            tps[name].append(t)
            taus[name].append(tau)
        same += outs["llama.py"] == outs["generic"]
        print(
            f"prompt {i:2d}: llama.py {tps['llama.py'][-1]:5.1f} tok/s  generic {tps['generic'][-1]:5.1f} "
            f"tok/s  x{tps['generic'][-1] / tps['llama.py'][-1]:.2f}  "
            f"{'identical' if outs['llama.py'] == outs['generic'] else 'DIFFERENT'}",
            flush=True,
        )
    model.family = paths["llama.py"]
    med = {k: statistics.median(v) for k, v in tps.items()}
    ratio = statistics.median(g / a for g, a in zip(tps["generic"], tps["llama.py"]))
    print(
        f"{len(items)} prompts, {args.max_tokens} tokens, {'plain' if args.plain else 'shipped heads'}: "
        f"llama.py {med['llama.py']:.1f} tok/s (tau {statistics.median(taus['llama.py']):.2f}), "
        f"generic {med['generic']:.1f} tok/s (tau {statistics.median(taus['generic']):.2f}); "
        f"generic / llama.py median x{ratio:.2f}; {same}/{len(items)} identical"
    )


if __name__ == "__main__":
    main()
