"""The decode loop on a tiny random llama: identity, stopping, limits, errors."""

import mlx.core as mx
import mlx_lm
import pytest
from helpers import assert_greedy_identical, mlx_lm_greedy, ours

from mlx_stream import OracleDrafter, PromptCache, chain, generate, stream_generate
from mlx_stream.heads import new_heads
from mlx_stream.tree import build_tree, sparse

PROMPTS = ["The quick brown fox", "Speculative decoding drafts", "0123 café", "heads, trees!"]
K = 3


@pytest.fixture()
def tiny_ref(tiny):
    model, tok = tiny
    refs = []
    for p in PROMPTS:
        ids = tok.encode(p)
        refs.append((ids, mlx_lm_greedy(model, tok, ids, 48)))
    return model, tok, refs


def test_plain_loop_is_mlx_lm(tiny_ref):
    model, tok, refs = tiny_ref
    for ids, ref in refs:
        got, rs = ours(model, tok, ids, 48)
        assert_greedy_identical(model, ids, got, ref)
        assert all(r.accepted == 0 for r in rs) and rs[-1].tau == pytest.approx(1.0)


@pytest.mark.parametrize("tree", [chain(K), sparse(K), build_tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])])
def test_greedy_identity_with_drafters(tiny_ref, tree):
    model, tok, refs = tiny_ref
    V = model.args.vocab_size
    model.heads = new_heads(model.backbone, tok, K, scale=0.5, seed=3)
    for ids, ref in refs:
        got, _ = ours(model, tok, ids, 48, tree=tree)  # random heads
        assert_greedy_identical(model, ids, got, ref)
        for wrong in (False, True):
            d = OracleDrafter(len(ids), ref, tree, V, wrong=wrong)
            got, rs = ours(model, tok, ids, 48, drafter=d)
            assert got == ref
            acc = sum(r.accepted for r in rs)
            if wrong:
                assert acc == 0
            else:  # every step but the last accepts the whole rank-0 path
                assert all(r.accepted == K for r in rs[1:-1])


@pytest.mark.parametrize("tree", [chain(K), sparse(K)])
@pytest.mark.parametrize("arch", ["hydra", "msa", "msa-copies"])
def test_greedy_identity_with_random_conditioned_heads(tiny_ref, tree, arch):
    model, tok, refs = tiny_ref
    model.heads = new_heads(
        model.backbone,
        tok,
        K,
        scale=0.5,
        seed=4,
        architecture=arch.split("-")[0],
        stream_layers=1,
        adapter_size=8,
        stream_copies=arch == "msa-copies",
    )
    for ids, ref in refs:
        got, _ = ours(model, tok, ids, 48, tree=tree)
        assert_greedy_identical(model, ids, got, ref)


def test_eos_at_every_offset_inside_a_chunk(tiny_ref):
    model, tok, refs = tiny_ref
    ids, ref = refs[0]
    for k in range(len(ref)):
        if ref[k] in ref[:k]:
            continue  # EOS must first occur at k
        saved = tok.eos_token_ids
        tok.eos_token_ids = {ref[k]}
        try:
            got, rs = ours(
                model, tok, ids, 48, drafter=OracleDrafter(len(ids), ref, chain(K), model.args.vocab_size)
            )
        finally:
            tok.eos_token_ids = saved
        assert got == ref[:k], k
        assert rs[-1].finish_reason == "stop"
        assert "".join(r.text for r in rs) == tok.decode(ref[:k])


def test_max_tokens_never_exceeded(tiny_ref):
    model, tok, refs = tiny_ref
    ids, ref = refs[1]
    for n in range(1, 3 * K + 1):
        for d in (OracleDrafter(len(ids), ref, chain(K), model.args.vocab_size), None):
            got, rs = ours(model, tok, ids, n, drafter=d)
            assert got == ref[:n]
            assert rs[-1].finish_reason == "length" and rs[-1].generation_tokens == n


def _detok_text(tok, ids):
    d = tok.detokenizer
    d.reset()
    for t in ids:
        d.add_token(t)
    d.finalize()
    return d.text


def test_stop_string_inside_an_accepted_chunk(tiny_ref):
    model, tok, refs = tiny_ref
    checked = 0
    for ids, ref in refs:
        full = _detok_text(tok, ref)
        if len(full) < 12:
            continue
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        cut = full.find(stop)
        got, rs = ours(
            model,
            tok,
            ids,
            48,
            stop=[stop],
            drafter=OracleDrafter(len(ids), ref, chain(K), model.args.vocab_size),
        )
        text = "".join(r.text for r in rs)
        assert text == full[:cut], (stop, text)
        assert rs[-1].finish_reason == "stop"
        # the token ids end with the token that completed the stop string
        assert got == ref[: len(got)]
        assert stop in _detok_text(tok, got) and stop not in _detok_text(tok, got[:-1])
        assert all(len(r.logprobs) == len(r.tokens) for r in rs)  # cut at the same boundary
        checked += 1
    assert checked >= 2


def test_generate_returns_the_streamed_text(tiny_ref):
    model, tok, refs = tiny_ref
    ids, ref = refs[2]
    assert generate(model, tok, ids, max_tokens=48) == mlx_lm.generate(model, tok, ids, max_tokens=48)


def test_context_limit_clamps_the_tree_and_ends_with_length(tiny):
    model, tok = tiny
    ctx = model.context_length
    model.heads = new_heads(model.backbone, tok, K, scale=0.5, seed=1)
    ids = (tok.encode(PROMPTS[0]) * 200)[: ctx - 2]
    ref = mlx_lm_greedy(model, tok, ids, 2)
    got, rs = ours(
        model, tok, ids, 100, drafter=OracleDrafter(len(ids), ref, chain(K), model.args.vocab_size)
    )
    assert got == ref[:2] and rs[-1].finish_reason == "length"
    assert len(ids) + len(got) == ctx


def test_prompt_longer_than_context_is_refused_before_any_forward(tiny):
    model, tok = tiny
    ctx = model.context_length
    cache = PromptCache(model)
    with pytest.raises(ValueError, match=f"{ctx + 5} tokens.*context window is {ctx}"):
        next(stream_generate(model, tok, [5] * (ctx + 5), prompt_cache=cache))
    assert cache.layers[0].offset == 0 and cache.layers[0].keys is None


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"temp": -0.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"tree": "bogus"}, "unknown tree"),
        ({"tree": "0;;1"}, "unknown tree"),
        ({"tree": "0,a"}, "unknown tree"),
        ({"tree": "1,0"}, "no parent"),
        ({"temp": 1.0, "top_p": 0.0}, "top_p"),
        ({"temp": 1.0, "top_p": 1.5}, "top_p"),
        ({"temp": 1.0, "top_k": -1}, "top_k"),
        ({"temp": float("nan")}, "temp"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"prompt_lookup": -2}, "prompt_lookup"),
    ],
)
def test_bad_parameters(tiny, kw, msg):
    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, K)
    with pytest.raises(ValueError, match=msg):
        next(stream_generate(model, tok, "hello", **kw))


def test_prompt_cache_reuse_matches_cold_run(tiny_ref):
    model, tok, refs = tiny_ref
    model.heads = new_heads(model.backbone, tok, K, scale=0.5, seed=2)
    cache = PromptCache(model)
    ids1, ref1 = refs[0]
    got1, _ = ours(model, tok, ids1, 20, prompt_cache=cache)
    turn2 = ids1 + got1 + tok.encode(" and then")
    warm, _ = ours(model, tok, turn2, 20, prompt_cache=cache)
    assert cache.tokens[: len(turn2)] == turn2
    cold, _ = ours(model, tok, turn2, 20)
    assert warm == cold


def test_sampling_is_seeded(tiny):
    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, K, scale=0.5, seed=2)
    a, _ = ours(model, tok, "The quick", 30, temp=5.0, seed=7)
    b, _ = ours(model, tok, "The quick", 30, temp=5.0, seed=7)
    others = {tuple(ours(model, tok, "The quick", 30, temp=5.0, seed=s)[0]) for s in range(8, 14)}
    assert a == b and len(others | {tuple(a)}) > 1  # (this model's top token has p ~ 0.98 at T = 5)


def test_text_that_may_become_a_stop_string_is_held_back(tiny):
    from mlx_stream.generate import _Emitter

    _, tok = tiny
    em = _Emitter(tok, 100, ["fox jumps"])
    first = tok.encode("The quick brown fox")
    delta, kept, reason = em.push(first)
    assert reason is None and kept == first and not delta.endswith("fox")  # "fox" may start the stop string
    delta2, _, reason = em.push(tok.encode(" runs"))
    assert reason is None and (delta + delta2).endswith("fox runs")  # it did not: released
    em = _Emitter(tok, 100, ["fox jumps"])
    d1, _, _ = em.push(first)
    d2, kept, reason = em.push(tok.encode(" jumps over"))
    assert reason == "stop" and d1 + d2 == "The quick brown "


def test_prompts_of_the_wrong_shape_are_refused(tiny):
    import numpy as np

    model, tok = tiny
    a, b = tok.encode("The quick brown fox"), tok.encode("naïve café")
    want = generate(model, tok, a, max_tokens=8)
    # the accepted forms give the same output
    for form in (a, tuple(a), mx.array(a), np.array(a), [np.int64(t) for t in a]):
        assert generate(model, tok, form, max_tokens=8) == want
    n = min(len(a), len(b))
    for bad, words in (
        (mx.array([a[:n], b[:n]]), "1-D"),  # a batch: plain mlx-lm raises too
        (mx.array([a]), "1-D"),
        (np.array([a[:n], b[:n]]), "1-D"),
        ([a, b], "token ids"),
        (mx.array([1.0, 2.0]), "integer"),
        (["The", "fox"], "token ids"),
        ([1, True], "token ids"),
        (12, "prompts are"),
        (None, "prompts are"),
        ([1, model.args.vocab_size], "outside the vocabulary"),
        ([-1, 2], "outside the vocabulary"),
    ):
        with pytest.raises(ValueError, match=words):
            generate(model, tok, bad, max_tokens=4)


def test_plain_decoding_one_step_ahead_keeps_the_cache_exact(tiny_ref):
    # plain decoding queues step t + 1 before reading step t back; stopped by a stop string
    # with a step in flight, the cache still holds exactly cache.tokens, and the next turn
    # on it equals a cold run
    from mlx_stream.cache import cache_offset

    model, tok, refs = tiny_ref
    ids, ref = refs[1]
    text = tok.decode(ref)
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cache = PromptCache(model)
    got, rs = ours(model, tok, ids, 48, prompt_cache=cache, stop=stop)
    assert rs[-1].finish_reason == "stop" and len(cache.tokens) < len(ids) + 47
    assert cache_offset(cache.layers) == len(cache.tokens) and cache.tokens[: len(ids)] == ids
    assert cache.tokens[len(ids) :] == ref[: len(cache.tokens) - len(ids)]
    turn2 = ids + got + tok.encode(" and then")
    warm, _ = ours(model, tok, turn2, 20, prompt_cache=cache)
    cold, _ = ours(model, tok, turn2, 20)
    assert warm == cold
    # the logits processors see the lazy token too: the same output as the drafting loop's
    proc = [mlx_lm.sample_utils.make_logits_processors(repetition_penalty=1.5)[0]]
    plain, _ = ours(model, tok, ids, 40, logits_processors=proc, temp=0.8, seed=5)
    wrong = OracleDrafter(len(ids), ref, chain(K), model.args.vocab_size, wrong=True)
    drafted, _ = ours(model, tok, ids, 40, logits_processors=proc, temp=0.8, seed=5, drafter=wrong)
    assert plain == drafted and len(plain) == 40


def test_a_generator_closed_with_steps_queued_leaves_the_cache_exact(tiny_ref):
    # a caller that stops reading (a server's client gone) closes the generator while plain
    # steps are queued: their keys/values are dropped, and the cache serves the next turn
    from mlx_stream.cache import cache_offset

    model, tok, refs = tiny_ref
    ids, ref = refs[2]
    cache = PromptCache(model)
    gen = stream_generate(model, tok, ids, 48, prompt_cache=cache)
    got = [t for _, r in zip(range(5), gen) for t in r.tokens]
    gen.close()
    assert (
        cache_offset(cache.layers) == len(cache.tokens)
        and cache.tokens[len(ids) :] == ref[: len(cache.tokens) - len(ids)]
    )
    turn2 = ids + got + tok.encode(" more")
    assert ours(model, tok, turn2, 12, prompt_cache=cache)[0] == ours(model, tok, turn2, 12)[0]


@pytest.mark.parametrize("arch, scale", [("hydra", 0.1), ("residual", 0.2)])
def test_drafting_steps_queued_ahead_keep_the_output_and_the_cache(spread_dir, arch, scale):
    # with the heads' static tree, step t + 1 (its root, position, drafts, mask and noise
    # all still on the device) is queued before step t is read back. Heads that accept all,
    # some and none of their drafts in turn: greedy equals mlx-lm, seeded sampling equals
    # seeded plain decoding, and a stop with a step in flight leaves the cache exact
    from mlx_stream import load
    from mlx_stream.cache import cache_offset

    model, tok = load(str(spread_dir), dtype="float32")
    model.heads = new_heads(model.backbone, tok, K, scale=scale, seed=3, architecture=arch)
    kw = {"adaptive": False, "prompt_lookup": 0}
    counts = set()
    for p in ["The quick brown fox", "heads, trees!"]:
        ids = tok.encode(p)
        ref = mlx_lm_greedy(model, tok, ids, 48)
        for tree in (chain(K), sparse(K)):
            got, rs = ours(model, tok, ids, 48, tree=tree, **kw)
            assert got == ref
            counts |= {r.accepted for r in rs[1:]}
            for seed in (0, 1):
                plain, _ = ours(model, tok, ids, 48, temp=1.0, seed=seed)
                assert ours(model, tok, ids, 48, tree=tree, temp=1.0, seed=seed, **kw)[0] == plain
            text = tok.decode(ref)
            cache = PromptCache(model)
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            got, rs = ours(model, tok, ids, 48, tree=tree, prompt_cache=cache, stop=stop, **kw)
            assert rs[-1].finish_reason == "stop"
            assert cache_offset(cache.layers) == len(cache.tokens)
            assert cache.tokens == ids + ref[: len(cache.tokens) - len(ids)]
            turn2 = ids + got + tok.encode(" then")
            assert ours(model, tok, turn2, 16, prompt_cache=cache)[0] == ours(model, tok, turn2, 16)[0]
    assert {0, K} <= counts or {0, 1} <= counts  # rejected drafts and accepted ones were both queued after


def test_device_acceptance_is_the_host_walk():
    # the acceptance a queued step is built on equals verify_greedy, duplicate siblings included
    import numpy as np

    from mlx_stream.tree import parse_tree
    from mlx_stream.verify import accepted_node, verify_greedy

    rng = np.random.default_rng(0)
    specs = ["0", "0;1", "0;1;0,0", "0;1;2;0,0;0,1;1,0;0,0,0", "0;0,0;0,0,0", "chain:1", "chain:4"]
    for spec in specs:  # (chains take their own shorter path)
        tree = parse_tree(spec, 4)
        for i in range(200):
            toks, targets = rng.integers(0, 3, tree.size), rng.integers(0, 3, tree.size)
            path, _ = verify_greedy(tree, toks.tolist(), targets.tolist())
            kind = mx.uint32 if i % 2 else mx.int32  # (the loop's targets are argmax's uint32)
            node = accepted_node(tree, mx.array(toks, dtype=mx.int32), mx.array(targets, dtype=kind))
            assert node.dtype == mx.int32 and node.item() == path[-1]


def test_sampling_drafts_with_the_heads_sampled_tree(tiny_ref, tmp_path):
    # heads that store a sampled_tree draft with it when sampling, and with `tree` when
    # greedy; a tree asked for overrides both; the field survives save and load
    from mlx_stream.bench import Decoding, side_by_side
    from mlx_stream.heads import HeadConfig, load_heads, save_heads
    from mlx_stream.speculation import stored_tree

    model, tok, refs = tiny_ref
    model.heads = new_heads(model.backbone, tok, K, scale=0.5, seed=3)
    model.heads.config.tree, model.heads.config.sampled_tree = "0", "0;1;0,0"
    ids, ref = refs[0]
    kw = {"adaptive": False, "prompt_lookup": 0}
    greedy, rs = ours(model, tok, ids, 24, **kw)
    assert greedy == ref[:24] and {r.drafted for r in rs[1:-1]} == {1}
    _, rs = ours(model, tok, ids, 24, temp=1.0, seed=0, **kw)
    assert {r.drafted for r in rs[1:-2]} == {3}
    _, rs = ours(model, tok, ids, 24, temp=1.0, seed=0, tree="0;1", **kw)
    assert {r.drafted for r in rs[1:-2]} == {2}
    # what `mlx-stream bench` reports as the tree drafted with when none is asked for
    assert stored_tree(model) == "0" and stored_tree(model, sampled=True) == "0;1;0,0"
    res = side_by_side(model, tok, ["Hello"], Decoding(6, None, 0, {"temp": 1.0}), log=lambda s: None)
    assert res["tree"] is None and res["stored_tree"] == "0;1;0,0"
    save_heads(model.heads, tmp_path / "heads")
    assert HeadConfig.from_file(tmp_path / "heads" / "config.json").sampled_tree == "0;1;0,0"
    assert load_heads(tmp_path / "heads").config.sampled_tree == "0;1;0,0"


def test_text_that_is_not_unicode_and_tree_ranks_past_the_vocabulary_are_refused(tiny):
    """Issue 48: a prompt or stop string with lone surrogates (bytes that were not UTF-8)
    and a tree rank >= the vocabulary get one-line ValueErrors naming the fix, not a
    tokenizer TypeError or MLX's argpartition error."""
    model, tok = tiny
    with pytest.raises(ValueError, match="the prompt is not valid Unicode.*errors='replace'"):
        generate(model, tok, "hi \udcff", max_tokens=2)
    with pytest.raises(ValueError, match="stop string is not valid Unicode"):
        generate(model, tok, "hi", max_tokens=2, stop=["\udcff"])
    model.heads = new_heads(model.backbone, tok, 2, seed=0, architecture="hydra")
    v = model.args.vocab_size
    with pytest.raises(ValueError, match=f"largest allowed is {v - 1}"):
        generate(model, tok, "hi", max_tokens=2, tree=str(v))
    with pytest.raises(ValueError, match=f"largest allowed is {v - 1}"):
        generate(model, tok, "hi", max_tokens=2, tree=f"0;0,{v + 5}")
    plain = generate(model, tok, "hi", max_tokens=6, tree="none", prompt_lookup=0)
    assert generate(model, tok, "hi", max_tokens=6, tree=f"{v - 1};0", prompt_lookup=0) == plain
