"""Held-out accuracy of stream heads against training data size, hard labels vs soft
targets, on one feature cache.

    python benchmarks/data_scaling.py --run runs/grow1 --sizes 40000,150000 \
        --kl-weights 0,1 --out runs/scaling.json

For each size N (the first N training positions of ``RUN/features/train``) and each KL
weight, fresh hydra heads (K = 4, the 8,192 most frequent target tokens of the whole
training cache as the draft vocabulary, so every row scores the same tokens) train for
``--epochs`` with `mlx-stream train`'s defaults otherwise, and are evaluated on
``RUN/features/valid``: per-head top-1 / top-5 and the tau implied by the chain, the
default sparse tree and the best trees of 5 and 15 nodes. With a cache built with
``--soft-targets K`` a KL weight > 0 trains on the stored top-K distribution, otherwise
on the distribution recomputed from the hidden states. One JSON line per row, then a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="an `mlx-stream train` output folder with features/")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sizes", default="40000,150000", help="training positions, comma-separated")
    ap.add_argument("--kl-weights", default="0,1")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()

    from mlx_stream.heads import new_heads
    from mlx_stream.loader import load
    from mlx_stream.train.config import TrainConfig
    from mlx_stream.train.features import load_features
    from mlx_stream.train.pipeline import choose_draft_vocab
    from mlx_stream.train.trainer import evaluate, head_ranks, train_heads
    from mlx_stream.tree import chain, sparse, tree_from_ranks

    model, tokenizer = load(args.model, heads=None)
    train = load_features(Path(args.run) / "features" / "train")
    valid = load_features(Path(args.run) / "features" / "valid")
    ids, _ = choose_draft_vocab(train, 8192)
    K = args.num_heads
    trees = {"chain": chain(K).choices, "sparse": sparse(K).choices}
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        sub = replace(
            train,
            hidden=train.hidden[:n],
            targets=train.targets[:n],
            top_logprobs=None if train.top_logprobs is None else train.top_logprobs[:n],
            top_ids=None if train.top_ids is None else train.top_ids[:n],
        )
        for kl in (float(s) for s in args.kl_weights.split(",")):
            heads = new_heads(model.backbone, tokenizer, K, 1, draft_ids=mx.array(ids), architecture="hydra")
            cfg = TrainConfig(num_heads=K, epochs=args.epochs, kl_weight=kl, checkpoint_every=0)
            tic = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                report = train_heads(model, heads, sub, tmp, cfg, progress=False)
            ev = evaluate(model, heads, valid, trees=trees)
            ranks = head_ranks(model, heads, valid)
            row = {
                "positions": len(sub),
                "kl_weight": kl,
                "soft": f"stored top-{train.top_k}"
                if kl and train.top_k
                else ("recomputed" if kl else "hard"),
                "epochs": args.epochs,
                "train_pos_per_s": round(report["tokens_per_s"], 1),
                "wall_s": round(time.perf_counter() - tic, 1),
                "top1": [round(x, 3) for x in ev["top1"]],
                "top5": [round(x, 3) for x in ev["top5"]],
                "tau_chain": round(ev["tau"]["chain"], 3),
                "tau_sparse": round(ev["tau"]["sparse"], 3),
                "tau_5": round(tree_from_ranks(ranks, 5)[1], 3),
                "tau_15": round(tree_from_ranks(ranks, 15)[1], 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    print(
        "| positions | targets | top-1, heads 1-4 | top-5 | tau chain | tau sparse | tau 5 | tau 15 | pos/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['positions']:,} | {r['soft']} | {' / '.join(f'{x:.2f}' for x in r['top1'])} | "
            f"{' / '.join(f'{x:.2f}' for x in r['top5'])} | {r['tau_chain']:.2f} | {r['tau_sparse']:.2f} | "
            f"{r['tau_5']:.2f} | {r['tau_15']:.2f} | {r['train_pos_per_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
