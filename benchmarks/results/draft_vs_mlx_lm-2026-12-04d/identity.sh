# greedy identity vs plain mlx-lm, the 20 built-in prompts, three drafts forced to draft (adaptive off)
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1
B=".venv/bin/mlx-stream bench --dtype float32 --no-adaptive --prompt-lookup 0 --draft-p-min 0 -n 20"
$B --draft-model smollm2-135m-instruct --num-draft-tokens 3 --max-tokens 128 --out runs/s30/id-4bit > runs/s30/id-4bit.log 2>&1
$B --draft-model self --num-draft-tokens 2 --max-tokens 64 --out runs/s30/id-self > runs/s30/id-self.log 2>&1
$B --draft-model /tmp/smol-q3 --tree dynamic:8,2 --max-tokens 64 --out runs/s30/id-q3 > runs/s30/id-q3.log 2>&1
