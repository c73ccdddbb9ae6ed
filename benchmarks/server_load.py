"""`mlx-stream server` under load and faults, on 127.0.0.1, bounded in count and time.

Starts a real server (the default model, float32, its shipped heads) with an API key,
``--max-queue`` below the burst and a 1 MB body cap, then sends ``--waves`` bursts of
``--clients`` concurrent requests with the official ``openai`` client (greedy, half of
them streaming, ``--tokens`` each; 10 streaming clients of each burst disconnect after
their third chunk), with malformed, oversized and unauthenticated requests interleaved.
Reported: every accepted request's text against the same request alone; every refused
one's status, ``Retry-After`` and time to the refusal; the faults' statuses; the
server's RSS before and after; p50/p95 time to first token and latency.

    python benchmarks/server_load.py --clients 100 --waves 5 --max-queue 20

(run with OpenBLAS preloaded, as `make` does).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import subprocess
import sys
import time

import httpx
import openai
from openai import OpenAI

KEY = "sk-load-test"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--waves", type=int, default=5)
    ap.add_argument("--max-queue", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--out", default=None, help="write the summary as JSON")
    a = ap.parse_args()

    from mlx_stream.prompts import BUILTIN_PROMPTS, load_prompts

    prompts = load_prompts(BUILTIN_PROMPTS)
    port = _port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlx_stream.cli", "server", "--model", a.model, "--port", str(port)]
    cmd += ["--dtype", "float32", "--api-key", KEY, "--max-queue", str(a.max_queue), "--max-body-mb", "1"]
    proc = subprocess.Popen([*cmd, "--log-level", "warning"])
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)

        def ask(p, stream=False, drop=False):
            msgs = [{"role": "user", "content": p}]
            tic = time.monotonic()
            try:
                if not stream:
                    r = client.chat.completions.create(model=a.model, messages=msgs, max_tokens=a.tokens)
                    t = time.monotonic() - tic
                    return {"status": 200, "text": r.choices[0].message.content, "ttft": t, "latency": t}
                text, ttft = [], None
                with client.chat.completions.create(
                    model=a.model, messages=msgs, max_tokens=a.tokens, stream=True
                ) as s:
                    for i, c in enumerate(s):
                        if c.choices and c.choices[0].delta.content:
                            ttft = ttft or time.monotonic() - tic
                            text.append(c.choices[0].delta.content)
                        if drop and i >= 2:
                            return {"status": "dropped"}
                t = time.monotonic() - tic
                return {"status": 200, "text": "".join(text), "ttft": ttft or t, "latency": t}
            except openai.APIStatusError as e:
                return {
                    "status": e.status_code,
                    "retry_after": e.response.headers.get("retry-after"),
                    "refused_s": time.monotonic() - tic,
                }

        def fault(kind):
            h = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
            if kind == "malformed":
                r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=h, timeout=60)
            elif kind == "oversized":
                body = json.dumps({"model": a.model, "prompt": "x" * (2 << 20)}).encode()
                r = httpx.post(url + "/v1/completions", content=body, headers=h, timeout=60)
            else:
                r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=60)
            return {"status": r.status_code, "fault": kind}

        solo = {p: ask(p)["text"] for p in prompts}  # each prompt alone, before any load
        rss = [_rss_mb(proc.pid)]
        rows, faults, tic = [], [], time.monotonic()
        for w in range(a.waves):
            jobs = []
            with concurrent.futures.ThreadPoolExecutor(a.clients + 30) as pool:
                for i in range(a.clients):
                    p = prompts[(w * a.clients + i) % len(prompts)]
                    stream = i % 2 == 1
                    jobs.append((p, pool.submit(ask, p, stream, stream and i % 10 == 1)))
                    if i % 10 == 5:
                        for kind in ("malformed", "oversized", "unauthenticated"):
                            faults.append(pool.submit(fault, kind))
                rows += [(p, f.result()) for p, f in jobs]
            rss.append(_rss_mb(proc.pid))
        faults = [f.result() for f in faults]
        ok = [r for _, r in rows if r["status"] == 200]
        summary = {
            "requests": len(rows),
            "accepted_completed": len(ok),
            "accepted_equal_to_solo": sum(r["text"] == solo[p] for p, r in rows if r["status"] == 200),
            "dropped_mid_stream": sum(r["status"] == "dropped" for _, r in rows),
            "refused_503": sum(r["status"] == 503 for _, r in rows),
            "refused_with_retry_after": sum(
                r["status"] == 503 and bool(r.get("retry_after")) for _, r in rows
            ),
            "refusal_s_max": max((r["refused_s"] for _, r in rows if r["status"] == 503), default=None),
            "other_status": sorted({str(r["status"]) for _, r in rows} - {"200", "503", "dropped"}),
            "faults": {
                k: sorted({f["status"] for f in faults if f["fault"] == k})
                for k in ("malformed", "oversized", "unauthenticated")
            },
            "rss_mb": {"before": rss[0], "after": rss[-1], "per_wave": rss},
            "ttft_s": {"p50": _pct([r["ttft"] for r in ok], 0.5), "p95": _pct([r["ttft"] for r in ok], 0.95)},
            "latency_s": {
                "p50": _pct([r["latency"] for r in ok], 0.5),
                "p95": _pct([r["latency"] for r in ok], 0.95),
            },
            "wall_s": time.monotonic() - tic,
            "health": httpx.get(url + "/health", timeout=5).json(),
        }
        print(json.dumps(summary, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(summary, f, indent=1)
        assert summary["accepted_equal_to_solo"] == summary["accepted_completed"], (
            "an answer differs from its solo run"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
