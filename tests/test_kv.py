"""Bounded (max_kv_size) and quantized (kv_bits) KV caches under tree verification:
greedy output equals plain mlx-lm with the same cache settings."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from helpers import ours
from mlx_lm.models.cache import RotatingKVCache

from mlx_stream import ChatSession, NoDrafter, OracleDrafter, PromptCache, chain, load
from mlx_stream.cache import TreeQuantizedKVCache, WindowKVCache
from mlx_stream.heads import new_heads


def mlx_lm_tokens(model, tok, ids, max_tokens, max_kv_size=None, **kw):
    """Plain mlx-lm's greedy tokens. ``max_kv_size`` builds the cache mlx-lm's
    ``make_prompt_cache(model, max_kv_size)`` documents (``RotatingKVCache(max_kv_size,
    keep=4)`` per layer) and hands it over: mlx-lm 0.32 ignores ``max_kv_size`` for
    models that define ``make_cache``, llama among them."""
    if max_kv_size is not None:
        kw["prompt_cache"] = [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in model.layers]
    out = []
    for r in mlx_lm.stream_generate(model, tok, mx.array(ids), max_tokens=max_tokens, **kw):
        if r.finish_reason == "stop" and r.token in tok.eos_token_ids:
            break
        out.append(r.token)
    return out


@pytest.fixture(scope="module")
def spread_model(spread_dir):
    # a model whose predictions depend on the context, with random heads
    mx.random.seed(5)
    model, tok = load(str(spread_dir), dtype="float32")
    model.heads = new_heads(model.backbone, tok, 3)
    return model, tok


def _drafters(model, ids, ref):
    yield "heads", {"tree": "0;1;0,0;0,0,0", "prompt_lookup": 4}
    yield "oracle", {"drafter": OracleDrafter(len(ids), ref, chain(3), model.args.vocab_size)}


@pytest.mark.parametrize("window", [24, 64])
def test_max_kv_size_greedy_equals_mlx_lm(spread_model, window):
    model, tok = spread_model
    text = "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens."
    short = tok.encode(text)[:10]
    long = tok.encode(text * 3)[: window + 20]  # longer than the window: prefilled in chunks
    n = 3 * window + 10
    for ids in (short, long):
        for step in (2048, 16):  # one prefill chunk, and several (mlx-lm's trimmed concatenation)
            ref = mlx_lm_tokens(model, tok, ids, n, max_kv_size=window, prefill_step_size=step)
            assert len(ids) + len(ref) > 3 * window
            for name, kw in _drafters(model, ids, ref):
                got, rs = ours(model, tok, ids, n, max_kv_size=window, prefill_step_size=step, **kw)
                assert got == ref, (name, step, len(ids))
                assert rs[-1].forward_passes < len(got) - 1 or name == "heads"


def test_max_kv_size_holds_memory_bounded(spread_model):
    model, tok = spread_model
    cache = PromptCache(model, max_kv_size=32)
    ids = tok.encode("The quick brown fox")
    got, _ = ours(model, tok, ids, 300, max_kv_size=32, prompt_cache=cache, tree="0;0,0")
    c = cache.layers[0]
    assert isinstance(c, WindowKVCache) and c.offset >= len(ids) + len(got) - 1
    assert c.offset - c.dropped <= 32 + c.slack + 4  # what is held stays bounded


def test_a_bounded_cache_runs_past_the_context_window(spread_model):
    model, tok = spread_model  # context 512
    got, rs = ours(model, tok, tok.encode("The quick brown fox"), 600, max_kv_size=64, tree="0;0,0")
    assert len(got) == 600 and rs[-1].finish_reason == "length"


def test_chat_with_max_kv_size_continues_past_the_window(spread_model):
    model, tok = spread_model
    chat = ChatSession(model, tok, max_tokens=40, max_kv_size=48, tree="0;1")
    for turn in ("The quick brown fox", "jumps over", "the lazy dog"):
        r = list(chat.send(turn))[-1]
    assert r.prompt_tokens > 48 and r.cached_tokens > 0  # the history is reused past the window


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Head dimension 64 (mx.quantize groups of 64), spread predictions, random heads."""
    from conftest import make_tiny_model_dir

    path = make_tiny_model_dir(
        tmp_path_factory.mktemp("wide") / "model", embed_scale=0.26, hidden=128, heads=2
    )
    mx.random.seed(6)
    model, tok = load(str(path), dtype="float32")
    model.heads = new_heads(model.backbone, tok, 3)
    return model, tok


@pytest.mark.parametrize("bits", [4, 8])
def test_kv_bits_greedy_equals_mlx_lm(wide, bits):
    model, tok = wide
    text = "Speculative decoding drafts tokens and verifies them in one pass."
    for ids, start in (
        (tok.encode(text)[:12], 0),
        (tok.encode(text)[:12], 30),
        (tok.encode(text * 2)[:50], 20),
    ):
        kv = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": start}
        ref = mlx_lm_tokens(model, tok, ids, 80, prefill_step_size=16, **kv)
        # plain decoding: drafting is refused with kv_bits (test_bad_kv_settings...)
        for name, kw in [("plain", {"drafter": NoDrafter()})]:
            cache = PromptCache(model)
            got, _ = ours(model, tok, ids, 80, prefill_step_size=16, prompt_cache=cache, **kv, **kw)
            assert got == ref, (name, bits, start, len(ids))
            c = cache.layers[0]
            assert isinstance(c, TreeQuantizedKVCache) and c.bits == bits  # really quantized
            assert c.keys[0].dtype == mx.uint32


def test_bad_kv_settings_are_refused_before_anything_runs(wide, spread_model):
    model, tok = wide
    for kw, words in (
        ({"kv_bits": 7}, "kv_bits"),
        ({"kv_bits": 4, "kv_group_size": 48}, "kv_group_size"),
        ({"kv_bits": 4, "max_kv_size": 64}, "cannot be combined"),
        ({"max_kv_size": 3}, "max_kv_size"),
        ({"max_kv_size": 64.5}, "max_kv_size"),
        ({"kv_bits": 4, "quantized_kv_start": -1}, "quantized_kv_start"),
        ({"max_kv_size": 64, "prompt_cache": PromptCache(model)}, "same max_kv_size"),
        ({"kv_bits": 4, "tree": "0;1"}, "cannot be combined with drafting"),
        (
            {"kv_bits": 4, "drafter": OracleDrafter(3, [5, 6], chain(1), 100)},
            "cannot be combined with drafting",
        ),
    ):
        with pytest.raises(ValueError, match=words):
            ours(model, tok, [1, 2, 3], 4, **kw)
    small, stok = spread_model  # head dimension 16: no group size divides it
    with pytest.raises(ValueError, match="head dimension 16"):
        ours(small, stok, [1, 2, 3], 4, kv_bits=4, kv_group_size=32)


# The tiny random models' greedy outputs hardly depend on distant context (a window or a
# quantized cache changes nothing), so the identities that can fail are on the real model.
@pytest.fixture()
def real_heads(real, shipped):
    """The default model as ``load("smollm2-135m-instruct", heads="default", dtype="float32")``
    gives it (the shipped heads and datastore, read only), made of the worker's loaded model."""
    from mlx_stream.datastore import DraftStore

    model, tok = real
    model.heads, model.datastore = shipped[0], DraftStore(shipped[1], None, learn=False)
    try:
        yield model, tok
    finally:
        model.heads = model.datastore = None


def _chat_ids(tok, text):
    msgs = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))


REAL_PROMPT = "Write a long story about a lighthouse keeper and a storm, with many details."


@pytest.fixture(scope="session")  # the worker's model: kept while other files' tests run between
def real_plain(real):
    """``plain(n)``: plain mlx-lm's first ``n`` greedy tokens after REAL_PROMPT with an
    unbounded, unquantized cache, computed once per worker for the longest ``n`` asked so
    far: greedy decoding emits the same first tokens whatever ``max_tokens`` is, so a
    shorter reference is a prefix of a longer one."""
    model, tok = real
    ids = _chat_ids(tok, REAL_PROMPT)
    longest = {"n": 0, "tokens": []}

    def plain(n):
        if n > longest["n"]:
            longest.update(n=n, tokens=mlx_lm_tokens(model, tok, ids, n))
        return longest["tokens"][:n]

    return plain


@pytest.mark.slow  # the tiny-model tests above run in the quick tier
@pytest.mark.parametrize("window", [64, 256])
def test_real_model_max_kv_size_equals_mlx_lm(real_heads, real_plain, window):
    model, tok = real_heads
    ids = _chat_ids(tok, REAL_PROMPT)
    n = 3 * window + 10 - len(ids)
    ref = mlx_lm_tokens(model, tok, ids, n, max_kv_size=window)
    assert len(ids) + len(ref) > 3 * window
    if window == 64:  # the window changes the output (at 256 this story comes out the same)
        assert ref != real_plain(n)
    got, rs = ours(model, tok, ids, n, max_kv_size=window)
    assert got == ref
    assert rs[-1].tau > 1.0  # drafting stayed on


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_real_model_kv_bits_equals_mlx_lm(real_heads, real_plain, bits):
    model, tok = real_heads
    ids = _chat_ids(tok, REAL_PROMPT)
    kv = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 40}
    ref = mlx_lm_tokens(model, tok, ids, 120, **kv)
    if bits == 4:
        assert ref != real_plain(120)  # 4-bit keys change the output
    cache = PromptCache(model)
    got, _ = ours(model, tok, ids, 120, prompt_cache=cache, drafter=NoDrafter(), **kv)  # plain only
    assert got == ref
    assert isinstance(cache.layers[0], TreeQuantizedKVCache)
    with pytest.raises(ValueError, match="cannot be combined with drafting"):
        ours(model, tok, ids, 4, **kv)  # the shipped heads would draft
