"""A long-lived process (an app, a chat left open): memory plateaus, behaviour does not drift."""

import mlx.core as mx
from helpers import ours

from mlx_stream.heads import new_heads

PROMPTS = ["The quick brown fox", "Speculative decoding drafts", "0123 café", "heads, trees!"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_300_generations_memory_plateaus_and_tau_holds(tiny):
    model, tok = tiny
    heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=6, architecture="hydra")
    probe = tok.encode("Speculative decoding drafts tokens and")

    def probe_run():
        model.heads = heads
        return ours(model, tok, probe, 40, adaptive=False)

    first_tokens, first = probe_run()
    active, rss = [], []
    for i in range(300):
        model.heads = heads if i % 2 else None  # heads on and off, alternating
        ours(model, tok, PROMPTS[i % len(PROMPTS)], 24, temp=0.0 if i % 3 else 0.8, seed=i)
        active.append(mx.get_active_memory() / 2**20)
        rss.append(_rss_mb())
    last_tokens, last = probe_run()
    assert last_tokens == first_tokens and last[-1].tau == first[-1].tau
    # after the first 20 generations, neither MLX's active memory nor the process grows by > 10%
    assert max(active[20:]) <= 1.1 * max(active[:20]) + 1.0, (max(active[:20]), max(active[20:]))
    assert max(rss[20:]) <= 1.1 * max(rss[:20]), (max(rss[:20]), max(rss[20:]))
    print(
        f"active MB after generation 20/100/200/300: {active[19]:.1f} {active[99]:.1f} {active[199]:.1f} "
        f"{active[299]:.1f}; RSS MB: {rss[19]:.0f} {rss[99]:.0f} {rss[199]:.0f} {rss[299]:.0f}; "
        f"probe tau {first[-1].tau:.3f} -> {last[-1].tau:.3f}"
    )
