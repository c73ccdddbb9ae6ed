# T = 0.7, 48 Spec-Bench prompts x 128 tokens, side by side in one process each (two processes, one per core):
# plain mlx-lm, mlx-lm K=2, ours as shipped, ours default tree (adaptive off)
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1
for s in 0 1; do
  .venv/bin/python benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --per-category 8 --max-tokens 128 --temp 0.7 --k 2 --chains --trees dynamic:16,4 --shard $s/2 --out runs/s30/t-$s.json --resume > runs/s30/t-$s.log 2>&1 &
done
wait
