"""Acceptance (tau) when sampling: Spec-Bench prompts, adaptive speculation and prompt lookup
off, so that tau measures the heads' drafts alone. Prompt i is seeded with i.

    python benchmarks/sampled_tau.py --temp 0.7 --tree 0 [--per-group 2] [--heads DIR]
"""

from __future__ import annotations

import argparse
import json

from mlx_stream import load, stream_generate
from mlx_stream.bench import prompt_ids
from mlx_stream.prompts import load_spec_bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temp", type=float, required=True)
    ap.add_argument("--tree", default=None, help="draft tree (default: the one stored with the heads)")
    ap.add_argument("--heads", default="default")
    ap.add_argument("--per-group", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model, tok = load("smollm2-135m-instruct", heads=args.heads, dtype="float32")
    made = passes = 0.0
    items = load_spec_bench(per_group=args.per_group)
    for i, it in enumerate(items):
        last = None
        for last in stream_generate(  # noqa: B007
            model,
            tok,
            prompt_ids(tok, it["prompt"]),
            max_tokens=args.max_tokens,
            temp=args.temp,
            seed=i,
            tree=args.tree,
            adaptive=False,
            prompt_lookup=0,
        ):
            pass
        made += last.tau * last.forward_passes
        passes += last.forward_passes
    print(
        json.dumps(
            {
                "temp": args.temp,
                "tree": args.tree,
                "heads": args.heads,
                "prompts": len(items),
                "tau": made / passes,
            }
        )
    )


if __name__ == "__main__":
    main()
