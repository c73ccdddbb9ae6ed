# Before (79d257a, with this benchmark file copied in) and after (the Backlog), alternated 3 times,
# each run 7 round-robin reps against plain mlx-lm in its own process; from the repository root:
#   git worktree add /tmp/before 79d257a && cp benchmarks/host_overhead.py /tmp/before/benchmarks/
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1
R=benchmarks/results/host_overhead-2026-12-07b
for i in 1 2 3; do
  (cd /tmp/before && PYTHONPATH=/tmp/before "$OLDPWD/.venv/bin/python" benchmarks/host_overhead.py --reps 7 \
    --models tiny --temps 0,0.7 --only plain,eagle-3,dflash --no-phases --json "$OLDPWD/$R/before-79d257a-$i.json")
  .venv/bin/python benchmarks/host_overhead.py --reps 7 --models tiny --temps 0,0.7 \
    --only plain,eagle-3,dflash --no-phases --json "$R/after-$i.json"
done
