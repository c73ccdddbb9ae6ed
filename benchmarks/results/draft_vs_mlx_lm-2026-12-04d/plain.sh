# greedy, 48 Spec-Bench prompts x 128 tokens, one process: plain mlx-lm vs ours as shipped (the 3-bit draft calibrated not to pay: plain decoding)
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1
.venv/bin/python benchmarks/draft_vs_mlx_lm.py --draft /tmp/smol-q3 --per-category 8 --max-tokens 128 --temp 0 --k --chains --trees --out runs/s30/plain.json --resume > runs/s30/plain.log 2>&1
