"""Positions per second of the stream heads' training step on a real feature cache.

    python benchmarks/train_step.py --features runs/grow1/features/train --steps 40 \
        [--num-heads 4] [--batch-size 256] [--kl-weight 1]

It trains fresh hydra heads (8,192-token draft vocabulary, as `mlx-stream train`) with
``mlx_stream.train.trainer.train_heads`` for ``--steps`` optimizer steps after a
warm-up of 5, and prints one JSON line with positions/s. Only APIs that older commits
also have are used, so the same script measures the trainer before and after a change
on the same features (``OPENBLAS_NUM_THREADS`` as given in the environment).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--kl-weight", type=float, default=0.0)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    args = ap.parse_args()

    from mlx_stream.heads import new_heads
    from mlx_stream.loader import load
    from mlx_stream.train.features import load_features
    from mlx_stream.train.pipeline import choose_draft_vocab
    from mlx_stream.train.trainer import TrainConfig, train_heads

    model, tokenizer = load(args.model, heads=None)
    feats = load_features(args.features)
    ids, _ = choose_draft_vocab(feats, args.draft_vocab)
    heads = new_heads(
        model.backbone, tokenizer, args.num_heads, 1, draft_ids=mx.array(ids), architecture="hydra"
    )
    cfg = TrainConfig(
        num_heads=args.num_heads,
        batch_size=args.batch_size,
        epochs=1.0,
        kl_weight=args.kl_weight,
        checkpoint_every=0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        train_heads(model, heads, feats, tmp, cfg, progress=False, stop_after=5)  # warm-up
        tic = time.perf_counter()
        train_heads(model, heads, feats, tmp, cfg, resume=False, progress=False, stop_after=args.steps)
        wall = time.perf_counter() - tic
    print(
        json.dumps(
            {
                "positions_per_s": round(args.steps * args.batch_size / wall, 1),
                "steps": args.steps,
                "batch_size": args.batch_size,
                "num_heads": args.num_heads,
                "kl_weight": args.kl_weight,
                "soft_targets_stored": feats.meta.get("top_k", 0),
                "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "unset"),
            }
        )
    )


if __name__ == "__main__":
    main()
