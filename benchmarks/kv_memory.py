"""Peak memory and tau of a long conversation under the KV cache settings.

One generation of ``--total`` tokens (a long prompt, then greedy output up to the
total; EOS ignored by a logits processor that masks it, so every run has the same
length) on the default model with its shipped heads, for each setting: the full
cache, ``max_kv_size`` and ``kv_bits`` (quantized from the start). Prints peak memory
(MLX's allocator, reset before each run), the KV cache's own size at the end, tau and
tokens/s as a markdown table.

    python benchmarks/kv_memory.py --total 4000

(run with OpenBLAS preloaded, as `make` does).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlx_stream import PromptCache, load, stream_generate


def cache_bytes(cache: PromptCache) -> int:
    total = 0
    for c in cache.layers:
        for a in (c.keys, c.values):
            for x in a if isinstance(a, tuple) else (a,):
                total += x.nbytes if x is not None else 0
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--total", type=int, default=4000, help="prompt + output tokens")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument(
        "--settings",
        default="full;max_kv_size=512;kv_bits=8;kv_bits=4",
        help="';'-separated runs: 'full' or key=value settings of stream_generate",
    )
    a = ap.parse_args()
    model, tok = load(a.model, heads="default", dtype="float32")
    text = open(__file__).read() * 20  # any long text
    msgs = [{"role": "user", "content": "Summarise and continue this file:\n" + text}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    ids = ids[: a.prompt_tokens]
    eos = list(tok.eos_token_ids)

    def no_eos(tokens, logits):
        return logits.at[..., eos].add(-1e9)

    n = a.total - len(ids)
    print(f"model {a.model} (float32, shipped heads); {len(ids)} prompt tokens + {n} generated\n")
    print("| KV cache | peak memory (GB) | KV cache at the end (MB) | tau | tokens/s |")
    print("|---|---|---|---|---|")
    for spec in a.settings.split(";"):
        kw = {}
        if spec != "full":
            for part in spec.split(","):
                k, v = part.split("=")
                kw[k] = int(v)
        if "kv_bits" in kw:
            kw.setdefault("quantized_kv_start", 0)
        cache = PromptCache(model, kw.get("max_kv_size"))
        mx.clear_cache()
        mx.reset_peak_memory()
        tic = time.perf_counter()
        *_, r = stream_generate(
            model, tok, ids, max_tokens=n, prompt_cache=cache, logits_processors=[no_eos], **kw
        )
        wall = time.perf_counter() - tic
        print(
            f"| {spec} | {mx.get_peak_memory() / 1e9:.3f} | {cache_bytes(cache) / 1e6:.1f} | {r.tau:.3f} | "
            f"{r.generation_tokens / wall:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
