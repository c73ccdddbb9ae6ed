#!/usr/bin/env bash
# shard $1 of 2: greedy and T = 0.7 per prompt (one prefill); resumable
cd /work/main
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1
.venv/bin/python benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --per-category 8 --max-tokens 128 --temp 0 0.7 --k 2 --chains --trees dynamic:16,4 --shard $1/2 --out runs/s28/a-$1.json --resume
