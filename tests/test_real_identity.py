"""Lossless greedy decoding on the real default model (SmolLM2-135M-Instruct, float32):
with the shipped trained heads (their own tree; with the shipped datastore, and the tree
budgeted across heads, prompt lookup and the datastore), random heads, an untrained EAGLE-style
draft layer (a chain and a dynamic tree) and an oracle drafter, the output equals plain
mlx-lm's greedy output token for token, 128 tokens: the defaults and the oracle on all 20
prompts, each of the others on 4-5 of them (CI's time). A drafter wrong at every depth is
tested on the tiny model (test_generate.py::test_greedy_identity_with_drafters: nothing
accepted, the output plain greedy's); what the real model adds there, the target's token
at a root whose drafts are all rejected, every prompt's rejected steps here check (the
defaults', and on 5 prompts the untrained draft layer's chain of the same shape)."""

import pytest
from helpers import assert_greedy_identical, mlx_lm_greedy, ours

from mlx_stream import OracleDrafter, chain
from mlx_stream.datastore import STORE_FILE, DraftStore, load_store
from mlx_stream.heads import new_heads
from mlx_stream.loader import default_heads_path
from mlx_stream.prompts import BUILTIN_PROMPTS, load_prompts
from mlx_stream.tree import sparse

PROMPTS = load_prompts(BUILTIN_PROMPTS)
MAX_TOKENS = 128
QUICK = (0,)  # the prompts `make test` runs; `make test-all` runs all 20
K = 3
SHIPPED_MIN_TAU = 1.1  # broken heads give ~1.0; every built-in prompt measured above this with SHIPPED_TREE
# a 5-node tree for the quality check (the tree stored with the heads is the fastest on
# this CPU, a single draft, whose tau is too coarse a per-prompt signal)
SHIPPED_TREE = "0;1;2;0,0;0,0,0"


@pytest.fixture(scope="session")
def shipped_heads(shipped):
    return shipped[0]  # conftest: loaded once per worker, checked against the backbone


@pytest.fixture(scope="session")  # seeded: the same heads whenever made
def random_heads(real):
    model, tok = real
    return new_heads(model.backbone, tok, K, scale=0.02, seed=0)


@pytest.fixture(scope="session")  # seeded: the same heads whenever made
def eagle_heads(real):
    # an untrained EAGLE-style draft layer (a copy of the top layer, random input projection)
    model, tok = real
    return new_heads(model.backbone, tok, K, architecture="eagle", seed=0)


@pytest.fixture(scope="session")
def plain_refs():
    """``{prompt index: plain mlx-lm's MAX_TOKENS greedy tokens}`` as test_greedy_identity_real
    computed them on this worker; a shorter plain reference of the same prompt is a prefix."""
    return {}


@pytest.mark.real
@pytest.mark.parametrize(
    "i", [i if i in QUICK else pytest.param(i, marks=pytest.mark.slow) for i in range(len(PROMPTS))]
)
def test_greedy_identity_real(real, shipped_heads, random_heads, eagle_heads, plain_refs, i):
    # every prompt: the defaults (the shipped heads, their tree, drafting steps queued) and
    # the oracle. The quick prompt also: the budgeted tree. The slow tier's prompts also, in
    # turn (prompt i: group i % 4, so that each runs on 4-5 prompts, CI's time kept):
    # 0: the shipped heads' larger tree (and its tau), random heads; 1: the shipped
    # datastore (the budgeted tree and the defaults), an untrained draft layer's chain;
    # 2: its dynamic tree (EAGLE-2); 3: nothing more (see the module's docstring)
    model, tok = real
    quick = i in QUICK
    group = None if quick else i % 4
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i]}], add_generation_prompt=True)
    ref = plain_refs[i] = mlx_lm_greedy(model, tok, ids, MAX_TOKENS)
    assert len(ref) == MAX_TOKENS, "the prompts are chosen to give answers of at least 128 tokens"
    V = model.args.vocab_size
    try:
        model.heads = shipped_heads
        got, _ = ours(model, tok, ids, MAX_TOKENS)  # the tree stored with the heads
        assert_greedy_identical(model, ids, got, ref)
        if group == 0:  # adaptive speculation off: this checks the heads' acceptance, not the speed policy
            got, rs = ours(model, tok, ids, MAX_TOKENS, tree=SHIPPED_TREE, adaptive=False)
            assert_greedy_identical(model, ids, got, ref)
            print(f"shipped heads: prompt {i} tau {rs[-1].tau:.2f}")  # visible with pytest -s
            assert rs[-1].tau > SHIPPED_MIN_TAU, f"trained heads accept too little: tau {rs[-1].tau:.2f}"
        # the shipped datastore's chains, and each step's tree budgeted across the three sources
        model.datastore = DraftStore(load_store(default_heads_path("smollm2-135m-instruct") / STORE_FILE))
        for tree in ("budget",) if quick else ("budget", None) if group == 1 else ():
            got, _ = ours(model, tok, ids, MAX_TOKENS, tree=tree)
            assert_greedy_identical(model, ids, got, ref)
        model.datastore = None
        if group == 0:
            model.heads = random_heads
            got, _ = ours(model, tok, ids, MAX_TOKENS, tree=sparse(K))
            assert_greedy_identical(model, ids, got, ref)
        if group in (1, 2):  # a draft layer with its own KV cache: a chain, EAGLE-2's dynamic tree
            model.heads = eagle_heads
            got, _ = ours(
                model, tok, ids, MAX_TOKENS, tree=chain(K) if group == 1 else "dynamic:6,3", adaptive=False
            )
            assert_greedy_identical(model, ids, got, ref)
    finally:
        model.heads = model.datastore = None
    got, rs = ours(model, tok, ids, MAX_TOKENS, drafter=OracleDrafter(len(ids), ref, sparse(K), V))
    assert_greedy_identical(model, ids, got, ref)
    assert rs[-1].tau > 3.0 or len(ref) < MAX_TOKENS


@pytest.mark.real
@pytest.mark.slow  # the quick tier checks processors on the tiny model (test_sampling.py)
@pytest.mark.parametrize("i", [0, 7])
def test_greedy_identity_real_with_processors(real, shipped_heads, plain_refs, i):
    """With repetition/presence penalties and a logit bias on, the shipped heads still
    give plain mlx-lm's greedy output (same processors), and the same log-probabilities."""
    import numpy as np
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = real
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i]}], add_generation_prompt=True)
    procs = make_logits_processors(
        logit_bias={tok.encode(" the")[0]: -4.0}, repetition_penalty=1.3, presence_penalty=0.2
    )
    ref_lp = []
    ref = mlx_lm_greedy(model, tok, ids, 64, logits_processors=procs, logprobs=ref_lp)
    plain = plain_refs[i][:64] if i in plain_refs else mlx_lm_greedy(model, tok, ids, 64)
    assert ref != plain  # the processors change the text
    try:
        model.heads = shipped_heads
        got, rs = ours(model, tok, ids, 64, tree=SHIPPED_TREE, logits_processors=procs, adaptive=False)
    finally:
        model.heads = None
    assert_greedy_identical(model, ids, got, ref)
    np.testing.assert_allclose([x for r in rs for x in r.logprobs], ref_lp, atol=1e-3)
    assert sum(r.accepted for r in rs) > 0


@pytest.mark.real
@pytest.mark.slow
def test_replay_matches_the_loop(real, shipped_heads):
    """eval-heads --replay: per prompt, the tokens and forward passes of a replayed greedy
    decode equal the real loop's (shipped heads, 5-node tree, prompt lookup)."""
    from mlx_stream.bench import Decoding, decode_items
    from mlx_stream.prompts import load_spec_bench
    from mlx_stream.train.replay import replay_items

    model, tok = real
    items = [it for it in load_spec_bench(None, 1) if it["group"] in ("summarization", "math_reasoning")]
    model.heads = shipped_heads
    try:
        got = replay_items(model, tok, items, 48, tree=SHIPPED_TREE)
        ref = decode_items(model, tok, items, Decoding(48, SHIPPED_TREE, None))
    finally:
        model.heads = None  # the worker's model is shared
    assert [(r["tokens"], r["forward_passes"]) for r in got] == [
        (pytest.approx(r["tokens"]), r["forward_passes"]) for r in ref
    ]
    assert sum(r["tokens"] for r in got) > 1.3 * sum(r["forward_passes"] for r in got)  # drafts were accepted
