"""Where the decode loop's time goes, from Python's own profiler (cProfile).

MLX is lazy: work runs where the host first needs a value, and MLX's functions are
not visible to cProfile, so their time counts as the calling Python function's own
time. The loop syncs once per step, when it reads the step back
(``StepPipeline.finish``: what of the heads' drafts, the forward pass, the output
projection and the argmax/probabilities did not run while the host served the step
before is waited for there; prompt lookup's chain is copied on the host and joins the
drafts without a sync). So the profile splits a step into:

* forward (compute): ``StepPipeline.finish``'s own time;
* graph building (Python): ``tree_hidden`` and ``project`` (ops recorded, not run);
* logits processing: ``TreeVerifier.judge`` (processors, log_softmax, filters, recorded);
* drafting (graph building and prompt lookup): ``propose`` (the heads' ops recorded,
  the context searched, the chain appended);
* verification: ``verify_greedy`` / ``verify_coupled``;
* KV cache: ``keep_path``;
* text: the stop-condition and detokenizer step (``push``);
* other Python: the rest of the generator.

Prefill is the loop's own timing of the prompt (as mlx-lm's ``prompt_tps``: up to the
first token, so its last projection is also under "forward"); "other Python" is what
remains and may come out slightly negative by that overlap.

Usage (OpenBLAS preloaded, one thread, on a quiet machine)::

    python benchmarks/profile_loop.py --prompts spec-bench --per-group 2 --max-tokens 128
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
from pathlib import Path


def _by_name(stats: pstats.Stats) -> dict:
    out = {}
    for (file, _line, name), (_cc, _nc, tt, ct, callers) in stats.stats.items():
        out.setdefault(name, []).append((file, tt, ct, callers))
    return out


def breakdown(stats: pstats.Stats, prefill_s: float = 0.0) -> dict:
    """Seconds per phase (see the module docstring) and the total; ``prefill_s`` (the
    prompts' prefill, measured by the loop itself) is split off "other Python"."""
    names = _by_name(stats)

    def cum(name, file_part=""):
        return sum(ct for f, tt, ct, _ in names.get(name, []) if file_part in f)

    def own(name, file_part=""):
        return sum(tt for f, tt, ct, _ in names.get(name, []) if file_part in f)

    total = cum("stream_generate", "generate.py")
    parts = {
        "prefill (compute)": prefill_s,
        "forward (compute, synced when a step is read back)": own("finish", "steps.py"),
        "graph building (tree_hidden, project)": cum("tree_hidden") + cum("project", "models"),
        "drafting (heads graph + prompt lookup)": cum("propose", "drafters/"),
        "verification (host)": cum("verify_greedy") + cum("verify_coupled"),
        "KV cache (keep_path)": cum("keep_path"),
        "text (stop strings, detokenizer)": cum("push", "generate.py"),
        "logits processing (log_softmax, sampling filters)": cum("judge", "steps.py"),
    }
    parts["other Python"] = total - sum(parts.values())
    return {"total_s": total, "phases_s": parts}


def main() -> None:
    import mlx_stream
    from mlx_stream.prompts import prompt_ids, select_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="spec-bench")
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--out", default=None, help="write the breakdown as JSON here")
    args = ap.parse_args()
    model, tok = mlx_stream.load(heads="default")
    texts, _ = select_prompts(args.prompts, args.limit, args.per_group)
    for _ in mlx_stream.stream_generate(model, tok, prompt_ids(tok, "Hello"), max_tokens=8):
        pass  # warm-up
    prof, tokens, passes, prefill = cProfile.Profile(), 0, 0, 0.0
    for t in texts:
        ids = prompt_ids(tok, t)
        prof.enable()
        for r in mlx_stream.stream_generate(  # noqa: B007 (the last response is read below)
            model, tok, ids, max_tokens=args.max_tokens, temp=args.temp, seed=0
        ):
            pass
        prof.disable()
        tokens, passes = tokens + r.generation_tokens, passes + r.forward_passes
        prefill += r.prompt_tokens / r.prompt_tps
    res = breakdown(pstats.Stats(prof), prefill)
    res.update({"prompts": len(texts), "tokens": tokens, "forward_passes": passes, "temp": args.temp})
    print(f"{len(texts)} prompts, {tokens} tokens, {passes} decoding passes, {res['total_s']:.1f} s")
    for k, v in res["phases_s"].items():
        print(
            f"  {k:45s} {v:7.2f} s  {100 * v / res['total_s']:5.1f}%  {1e3 * v / max(passes, 1):6.2f} ms/pass"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
