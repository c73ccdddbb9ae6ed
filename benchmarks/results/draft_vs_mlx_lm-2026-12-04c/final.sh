# greedy, 48 Spec-Bench prompts x 128 tokens, side by side in one process each (two processes, one per core)
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1
for s in 0 1; do
  .venv/bin/python benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --per-category 8 --max-tokens 128 --temp 0 --k 2 --chains --trees dynamic:16,4 dynamic:16,4,2@0 --shard $s/2 --out runs/f-$s.json --resume > runs/f-$s.log 2>&1 &
done
wait
# the last prompts of shard 0 were shared with a second process from the other end (one row per prompt counts):
# python benchmarks/draft_vs_mlx_lm.py ... --shard 0/2 --reverse --out runs/f-0r.json
