"""Peak memory and tau of a long conversation under the KV cache settings.

A multi-turn chat (:class:`mlx_stream.ChatSession`, the KV cache kept across turns, as
``mlx-stream chat``) on the default model with its shipped heads, greedy, asking the
questions below in turn (replies up to ``--reply-tokens``) until the conversation holds
``--total`` tokens; once for each KV cache setting: the full cache, ``max_kv_size``,
``kv_bits`` (quantized from the start; plain decoding, as drafting is refused
with it). Prints peak memory (MLX's allocator, reset
before each conversation), the KV cache's size at the end, tau over all replies and
tokens/s as a markdown table.

    python benchmarks/kv_memory.py --total 4000

(run with OpenBLAS preloaded, as `make` does).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlx_stream import ChatSession, NoDrafter, PromptCache, load


def cache_bytes(cache: PromptCache) -> int:
    total = 0
    for c in cache.layers:
        for a in (c.keys, c.values):
            for x in a if isinstance(a, (tuple, list)) else (a,):
                total += x.nbytes if x is not None else 0
    return total


QUESTIONS = [
    "Tell me the story of a lighthouse keeper who finds a message in a bottle.",
    "What happened next? Continue the story with more details.",
    "Describe the lighthouse itself: its history, its rooms and its lamp.",
    "Now write a letter from the keeper to his sister about that winter.",
    "Summarise the story so far in a few sentences.",
    "Explain how a lighthouse lens works, step by step.",
    "Write a short poem about the sea at night.",
    "What could the keeper do to pass the long evenings? Give ten ideas.",
    "Continue the story: a storm arrives and a ship is in trouble.",
    "How does the story end? Write the last chapter.",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--total", type=int, default=4000, help="tokens in the conversation at the end")
    ap.add_argument("--reply-tokens", type=int, default=400)
    ap.add_argument(
        "--settings",
        default="full;max_kv_size=512;kv_bits=8;kv_bits=4",
        help="';'-separated runs: 'full' or key=value settings of stream_generate",
    )
    a = ap.parse_args()
    model, tok = load(a.model, heads="default", dtype="float32")
    print(f"model {a.model} (float32, shipped heads), greedy chat up to {a.total} tokens\n")
    print("| KV cache | turns | tokens | peak memory (GB) | KV cache at the end (MB) | tau | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for spec in a.settings.split(";"):
        kw = {}
        if spec != "full":
            for part in spec.split(","):
                k, v = part.split("=")
                kw[k] = int(v)
        if "kv_bits" in kw:
            kw.setdefault("quantized_kv_start", 0)
            kw["drafter"] = NoDrafter()  # drafting is refused with kv_bits: plain decoding
            spec += " (plain decoding)"
        chat = ChatSession(model, tok, max_tokens=a.reply_tokens, **kw)
        mx.clear_cache()
        mx.reset_peak_memory()
        tic, generated, passes, turns, length = time.perf_counter(), 0, 0, 0, 0
        while length < a.total:
            *_, r = chat.send(QUESTIONS[turns % len(QUESTIONS)])
            turns += 1
            generated += r.generation_tokens
            passes += r.forward_passes
            length = r.prompt_tokens + r.generation_tokens
        wall = time.perf_counter() - tic
        tau = (generated - turns) / max(passes, 1)  # tokens after each reply's first, per pass
        print(
            f"| {spec} | {turns} | {length} | {mx.get_peak_memory() / 1e9:.3f} | "
            f"{cache_bytes(chat.cache) / 1e6:.1f} | {tau:.3f} | {generated / wall:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
