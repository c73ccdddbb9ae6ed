#!/usr/bin/env bash
# shard $1 of 2: greedy (tree + chain K=2), then T = 0.7 (tree); resumable
cd /work/main
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1
P=.venv/bin/python
$P benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --per-category 8 --max-tokens 128 --temp 0 --chains 2 --shard $1/2 --out runs/s27/greedy-$1.json --resume
$P benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --per-category 8 --max-tokens 128 --temp 0.7 --chains --shard $1/2 --out runs/s27/t07-$1.json --resume
