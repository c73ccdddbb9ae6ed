"""`mlx-stream train` on one machine's cores, three ways, side by side on the same prompts:
2 ranks x 1 thread (``mlx.launch -n 2``), 1 rank x 2 threads (``OPENBLAS_NUM_THREADS=2``, two
loss streams) and ``--workers 2`` (the same two ranks, started by the command itself).

    python benchmarks/ranks.py --prompts benchmarks/data/magpie_256.jsonl --limit 64 \
        --max-tokens 128 --rounds 3 [--baseline-src DIR]

Each round runs every configuration once, one after the other (never two at a time), in a
fresh folder, and reads its ``report.json``: data-stage tokens/s (self-distilled positions
over the data stage's wall time, model loading included) and training positions/s (the
trainer's own count). Prints one JSON line per run, then the medians per configuration.

``--baseline-src DIR`` adds ``pool2``: ``--workers 2`` of another build of mlx-stream (a
non-editable install of an earlier commit in DIR, put first on ``PYTHONPATH``), e.g. the
spawned-process pool that ranks replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def configs(common: list[str], baseline: str | None) -> dict[str, tuple[list[str], dict]]:
    from mlx_stream.distributed import free_ports

    cli = [sys.executable, "-m", "mlx_stream.cli", "train", *common]
    one = {"OPENBLAS_NUM_THREADS": "1"}
    out = {
        "ranks2x1": (
            [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(free_ports(1)[0]), "--", *cli],
            one,
        ),
        "rank1x2": (cli, {"OPENBLAS_NUM_THREADS": "2"}),
        "workers2": ([*cli, "--workers", "2"], one),
    }
    if baseline:
        out["pool2"] = ([*cli, "--workers", "2"], one | {"PYTHONPATH": baseline})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="jsonl with a 'prompt' per line")
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--epochs", default="2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-src", default=None)
    ap.add_argument("--only", default="", help="comma-separated configurations to run (default: all)")
    args = ap.parse_args()

    rows = [json.loads(x) for x in Path(args.prompts).read_text().splitlines() if x.strip()][: args.limit]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
        for rnd in range(args.rounds):
            common = ["--model", args.model, "--data", str(data), "--max-tokens", str(args.max_tokens)]
            common += ["--epochs", args.epochs, "--no-tune", "--checkpoint-every", "0"]
            for name, (cmd, env) in configs(common, args.baseline_src).items():
                if args.only and name not in args.only.split(","):
                    continue
                out = Path(tmp) / f"{name}-{rnd}"
                full_env = os.environ | env | {"MLX_STREAM_NO_REEXEC": "1"}
                if Path(OPENBLAS).exists():
                    full_env["LD_PRELOAD"] = OPENBLAS
                # stdin an open pipe that never delivers: mlx.launch polls its stdin and spins a
                # core when that is at end of file (/dev/null, a closed pipe)
                log = Path(tmp) / f"{name}-{rnd}.log"
                with open(log, "w") as f:
                    p = subprocess.Popen(
                        [*cmd, "--out", str(out)], env=full_env, stdin=subprocess.PIPE, stdout=f, stderr=f
                    )
                    rc = p.wait()
                    p.stdin.close()
                if rc != 0 or not (out / "report.json").is_file():
                    sys.exit(f"{name}: failed\n{log.read_text()[-3000:]}")
                rep = json.loads((out / "report.json").read_text())
                positions = sum(rep["data_tokens"].values())
                row = {
                    "config": name,
                    "round": rnd,
                    "positions": positions,
                    "data_s": round(rep["data_and_features_s"], 1),
                    "data_tokens_per_s": round(positions / rep["data_and_features_s"], 1),
                    "train_positions_per_s": round(rep["tokens_per_s"], 1),
                    "total_s": round(rep["total_wall_s"], 1),
                }
                print(json.dumps(row), flush=True)
                results.setdefault(name, []).append(row)
    summary = {
        name: {
            k: statistics.median(r[k] for r in rs)
            for k in ("data_tokens_per_s", "train_positions_per_s", "data_s", "total_s")
        }
        for name, rs in results.items()
    }
    print(json.dumps({"medians": summary, "rounds": args.rounds, "prompts": len(rows)}), flush=True)


if __name__ == "__main__":
    main()
