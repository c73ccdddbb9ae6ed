"""`mlx-stream server` on the default model, as a client sees it.

Starts a real server process (the default model, float32, its shipped heads) on a free
port on 127.0.0.1 and prints, as markdown:

1. a transcript: the official `openai` client, streaming chat, two turns, with the
   `usage` and `speculation` fields of the last chunk;
2. four clients at once (64 tokens each, greedy): each answer against its solo run, and
   the wall time of the four together against the sum of the solo times;
3. the bad-request table (request -> status, error message);
4. tokens/s through the server (streaming) vs `mlx_stream.stream_generate` in this
   process on the same prompt, the two alternated, medians of ``--runs``.

    python benchmarks/server_check.py --runs 5

(run with OpenBLAS preloaded, as `make` does).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import statistics
import subprocess
import sys
import time

import httpx
from openai import OpenAI


def start_server(model: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlx_stream.cli", "server", "--model", model, "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--dtype", "float32", "--log-level", "warning"])
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per run in the tokens/s comparison")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = start_server(a.model, port)
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        print("## Transcript (openai client, streaming chat, two turns)\n")
        msgs = []
        for turn in ("What is speculative decoding? Two sentences.", "Give an everyday analogy for it."):
            msgs.append({"role": "user", "content": turn})
            text, last = [], None
            for chunk in client.chat.completions.create(
                model=a.model,
                messages=msgs,
                max_tokens=96,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                last = chunk
            reply = "".join(text)
            msgs.append({"role": "assistant", "content": reply})
            print(f"**user**: {turn}\n\n**assistant**: {reply}\n")
            print(f"usage: `{last.usage.model_dump_json(exclude_none=True)}`  ")
            print(f"speculation: `{json.dumps(last.model_extra['speculation'])}`\n")

        print("## Four clients at once (64 tokens each, greedy)\n")
        prompts = [
            "Write a limerick about a cat.",
            "List three uses of a paperclip.",
            "Explain what a hash table is.",
            "Translate 'good morning' into French and Spanish.",
        ]

        def ask(p):
            tic = time.perf_counter()
            r = client.chat.completions.create(
                model=a.model, messages=[{"role": "user", "content": p}], max_tokens=64
            )
            return r.choices[0].message.content, time.perf_counter() - tic

        solo = [ask(p) for p in prompts]
        tic = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, prompts))
        wall = time.perf_counter() - tic
        same = sum(t[0] == s[0] for t, s in zip(together, solo))
        print(f"identical to the solo runs: {same}/4; wall time of the four together {wall:.2f} s ")
        print(
            f"(solo times summed {sum(s[1] for s in solo):.2f} s; requests are served one decode at a time)\n"
        )

        print("## Bad requests\n\n| request | status | error message |\n|---|---|---|")
        bad = [
            ("POST /v1/chat/completions", '{"messages": ['),
            ("POST /v1/chat/completions", "{}"),
            ("POST /v1/chat/completions", '{"messages": [{"role": "robot", "content": "x"}]}'),
            ("POST /v1/completions", '{"prompt": "x", "temperature": -1}'),
            ("POST /v1/completions", '{"prompt": "x", "top_p": 1.5}'),
            ("POST /v1/completions", '{"prompt": "x", "max_tokens": 0}'),
            ("POST /v1/completions", '{"prompt": "x", "n": 3}'),
            ("POST /v1/completions", '{"prompt": "' + "hello " * 9000 + '"}'),
            ("POST /v1/completions", '{"model": "gpt-4", "prompt": "x"}'),
            ("GET /v1/nothing", ""),
            ("POST /v1/models", ""),
        ]
        for route, body in bad:
            method, path = route.split()
            r = httpx.request(
                method, url + path, content=body, headers={"content-type": "application/json"}, timeout=60
            )
            shown = body if len(body) < 60 else body[:40] + f"... ({len(body)} chars)"
            msg = r.json()["error"]["message"]
            print(f"| `{route}` `{shown}` | {r.status_code} | {msg} |")
        ok = client.completions.create(model=a.model, prompt="Hello", max_tokens=4)
        print(f"\nafter them, a good request: finish_reason {ok.choices[0].finish_reason!r}\n")

        print(f"## Tokens/s: server (streaming) vs stream_generate in-process ({a.max_tokens} tokens)\n")
        import mlx.core as mx

        from mlx_stream import PromptCache, load, stream_generate

        model, tok = load(a.model, heads="default", dtype="float32")
        msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        srv, lib, cache = [], [], PromptCache(model)  # both reuse the prompt's cache after run 1
        for _ in range(a.runs):
            tic, n = time.perf_counter(), 0
            for chunk in client.chat.completions.create(
                model=a.model,
                messages=msgs,
                max_tokens=a.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if not chunk.choices:
                    n = chunk.usage.completion_tokens
            srv.append(n / (time.perf_counter() - tic))
            tic = time.perf_counter()
            r = list(stream_generate(model, tok, prompt, max_tokens=a.max_tokens, prompt_cache=cache))[-1]
            mx.synchronize()
            lib.append(r.generation_tokens / (time.perf_counter() - tic))
        ms, ml = statistics.median(srv), statistics.median(lib)
        print("| path | tokens/s (median) | runs |\n|---|---|---|")
        print(f"| server, streaming | {ms:.1f} | {' '.join(f'{x:.1f}' for x in srv)} |")
        print(f"| stream_generate | {ml:.1f} | {' '.join(f'{x:.1f}' for x in lib)} |")
        print(
            f"\nserver / in-process: {ms / ml:.3f} (time to the last token; both reuse the prompt's KV cache)"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
