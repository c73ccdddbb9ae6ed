"""Lossless sampling: the speculative loop draws the first tokens with exactly the
plain model's distribution under every sampling setting (chi-square against the
exact distribution), and the same test rejects biased verifiers."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from helpers import SelfDrafter, mlx_lm_greedy, ours
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from scipy.stats import chisquare

from mlx_stream import load, stream_generate
from mlx_stream.heads import new_heads
from mlx_stream.sampling import SamplingParams, log_softmax, process_logits
from mlx_stream.tree import parse_tree
from mlx_stream.verify import sample_index

N_SAMPLES = 20_000
N_QUEUED = 5_000
N_BIASED = 2_000  # p 0 and 7e-81 here for the two biased verifiers (no_residual: 4e-32 at 1,000)
TOKENS = 3  # the joint distribution of the first 3 generated tokens is tested
TREE = "0;1;0,0;0,1"  # two candidates at depth 1, two more under the first
ALPHA = 0.01

# The loop draws every sampled token the same way whatever the setting (TreeVerifier.judge):
# the processors at each node (if any), then SamplingParams.mask, the temperature and the
# position's Gumbel noise; exact_bins uses SamplingParams.distribution with the same mask.
# So two settings cover the loop: a temperature with a filter that cuts the support, and a
# processor. The settings dropped as redundant, and what covers them:
#   T=1 (no filter, no processor): the queued drafting steps' test below (that distribution
#     exactly, 5,000 runs) and repetition_penalty=1.3 (T=1, nothing masked, 20,000 runs);
#   top_k=5: T=0.7,top_p=0.9 (a mask that cuts the support, 20,000 runs), and what top-k
#     (any mask) does to a tree's (N, V) rows against one sequential (1, V) row:
#     test_masks_act_on_each_row_as_on_one_row (quick tier).
SETTINGS = {
    "T=0.7,top_p=0.9": ({"temp": 0.7, "top_p": 0.9}, None),
    "repetition_penalty=1.3": ({"temp": 1.0}, 1.3),
}


@pytest.fixture(scope="module")
def spread(spread_dir):
    model, tok = load(str(spread_dir), dtype="float32")
    return model, tok, tok.encode("The quick")


def _target(model, history, sampling, processors):
    """Plain decoding's distribution of the next token after ``history`` (mlx-lm's
    processors on the model's own logits, one sequential forward)."""
    logits = model.backbone(mx.array(history)[None])[:, -1, :]
    for proc in processors:
        logits = proc(mx.array(history), logits)
    return np.array(sampling.distribution(log_softmax(logits))[0], dtype=np.float64)


def exact_bins(model, tok, ids, sampling, processors, n):
    """Outcomes (up to TOKENS tokens, shorter when EOS comes first) whose exact
    probability under plain decoding gives an expected count >= 5 in n samples,
    chosen before sampling: {outcome: probability}."""
    eos = set(tok.eos_token_ids)
    bins, frontier = {}, [((), 1.0)]
    for _ in range(TOKENS):
        grown = []
        for prefix, p in frontier:
            dist = _target(model, ids + list(prefix), sampling, processors)
            for t in np.nonzero(dist * p * n >= 5)[0]:
                outcome, q = prefix + (int(t),), p * float(dist[t])
                if int(t) in eos or len(outcome) == TOKENS:
                    bins[outcome] = q
                else:
                    grown.append((outcome, q))
        frontier = grown
    return bins


def sample_outcomes(model, tok, ids, kw, processors, n, verifier=None, drafter=None, max_tokens=TOKENS + 1):
    (eos_id,) = tok.eos_token_ids
    drafter = drafter if drafter is not None else SelfDrafter(model, parse_tree(TREE, 2))
    counts = {}
    for seed in range(n):
        toks, eos = [], False
        gen = stream_generate(
            model,
            tok,
            ids,
            max_tokens=max_tokens,
            drafter=drafter,
            seed=seed,
            logits_processors=processors,
            verifier=verifier,
            **kw,
        )  # max_tokens past TOKENS: the steps that emit the first TOKENS draft full trees
        for r in gen:
            toks.extend(r.tokens)
            eos = r.finish_reason == "stop"
            if len(toks) >= TOKENS:  # the outcome is decided: later steps are dropped unfinished
                break
        gen.close()
        out = tuple(toks[:TOKENS]) + ((eos_id,) if eos and len(toks) < TOKENS else ())
        counts[out] = counts.get(out, 0) + 1
    return counts


def chi_square(counts, bins, n):
    obs = [counts.get(b, 0) for b in bins] + [n - sum(counts.get(b, 0) for b in bins)]
    exp = [p * n for p in bins.values()] + [n * (1 - sum(bins.values()))]
    stat, p = chisquare(obs, exp)
    return float(stat), float(p), len(obs) - 1


@pytest.mark.slow  # a chi-square test: minutes (make test-all)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampled_tokens_follow_the_plain_distribution(spread, name):
    model, tok, ids = spread
    kw, penalty = SETTINGS[name]
    procs = make_logits_processors(repetition_penalty=penalty)
    bins = exact_bins(model, tok, ids, SamplingParams(**kw), procs, N_SAMPLES)
    counts = sample_outcomes(model, tok, ids, kw, procs, N_SAMPLES)
    stat, p, dof = chi_square(counts, bins, N_SAMPLES)
    print(
        f"\n{name}: chi2 {stat:.1f}, dof {dof}, p {p:.3f}, top outcome share "
        f"{max(counts.values()) / N_SAMPLES:.3f}"
    )
    assert len(bins) >= 20  # the test has bins to speak of
    assert p > ALPHA, f"{name}: speculative sampling differs from plain sampling (chi2 {stat:.1f}, p {p:.2e})"


@pytest.mark.slow  # a chi-square test: minutes (make test-all)
def test_sampled_tokens_follow_the_plain_distribution_with_queued_drafting_steps(spread):
    # the heads' static tree: a drafting step is queued before the step before it is read
    # back (its root, position, coupled drafts and noise on the device); 7 tokens are
    # generated, so the first 3 also come from steps queued after a drafting step (5,000
    # runs, more than the biased verifiers' test: the slow tier's time). T=1, nothing
    # masked, no processors: also the plain temperature-1 distribution's test.
    from mlx_stream.drafters import HeadsDrafter

    model, tok, ids = spread
    kw = {"temp": 1.0}
    heads, model.heads = model.heads, new_heads(model.backbone, tok, 2, scale=0.0, seed=3)
    try:
        drafter = HeadsDrafter(model, parse_tree("0;1;0,0", 2))
        accepted = sum(
            r.accepted for r in stream_generate(model, tok, ids, 40, drafter=drafter, seed=0, **kw)
        )
        assert accepted >= 5  # drafts are accepted, so queued steps follow accepted and rejected ones
        bins = exact_bins(model, tok, ids, SamplingParams(**kw), [], N_QUEUED)
        counts = sample_outcomes(model, tok, ids, kw, [], N_QUEUED, drafter=drafter, max_tokens=TOKENS + 4)
    finally:
        model.heads = heads
    stat, p, dof = chi_square(counts, bins, N_QUEUED)
    print(f"\nqueued drafting steps, T=1: chi2 {stat:.1f}, dof {dof}, p {p:.3f}")
    assert len(bins) >= 20
    assert p > ALPHA, f"queued drafting steps differ from plain sampling (chi2 {stat:.1f}, p {p:.2e})"


def greedy_acceptance(tree, tokens, probs, uniforms):
    """Biased: accept a draft when it is the target's most likely token; otherwise
    sample from the target's distribution (the argmax is over-represented)."""
    node, path = 0, [0]
    while True:
        best = int(np.argmax(probs[node]))
        nxt = next((c for c in tree.children[node] if tokens[c] == best), None)
        if nxt is None:
            return path, sample_index(probs[node], uniforms[int(tree.depths[node])])
        node = nxt
        path.append(node)


def no_residual(tree, tokens, probs, uniforms):
    """Biased: the acceptance test is right, but after a rejection it samples from the
    target's distribution instead of the residual (the rejected draft can come back)."""
    rng = np.random.default_rng(int(uniforms[0] * 2**53))
    node, path = 0, [0]
    while True:
        p = np.asarray(probs[node], dtype=np.float64)
        nxt = next((c for c in tree.children[node] if rng.random() < p[tokens[c]]), None)
        if nxt is None:
            return path, int(rng.choice(p.shape[0], p=p / p.sum()))
        node = nxt
        path.append(node)


@pytest.mark.slow  # a chi-square test: minutes (make test-all)
@pytest.mark.parametrize("verifier", [greedy_acceptance, no_residual])
def test_the_same_test_rejects_a_biased_verifier(spread, verifier):
    model, tok, ids = spread
    kw = {"temp": 1.0}
    bins = exact_bins(model, tok, ids, SamplingParams(**kw), [], N_BIASED)
    counts = sample_outcomes(model, tok, ids, kw, [], N_BIASED, verifier=verifier)
    stat, p, dof = chi_square(counts, bins, N_BIASED)
    print(f"\n{verifier.__name__}: chi2 {stat:.1f}, dof {dof}, p {p:.2e}")
    assert p < ALPHA, f"{verifier.__name__} went undetected (p {p:.3f})"


@pytest.mark.parametrize(
    "kw",
    [
        {"temp": 1.0},
        {"temp": 0.7, "top_p": 0.9},
        {"temp": 1.0, "top_k": 5},
        {"temp": 0.8, "min_p": 0.1},
        {"temp": 1.3, "top_p": 0.5, "top_k": 20, "min_p": 0.02},
    ],
)
def test_distribution_is_mlx_lm_samplers(kw):
    """SamplingParams.distribution is what mlx-lm's make_sampler draws from."""
    mx.random.seed(5)
    logits = mx.random.normal((1, 50)) * 2.0
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    draws = make_sampler(**kw)(mx.repeat(logprobs, N_SAMPLES, axis=0))
    counts = np.bincount(np.array(draws), minlength=50)
    p = np.array(SamplingParams(**kw).distribution(logprobs)[0], dtype=np.float64)
    assert counts[p == 0].sum() == 0  # nothing outside the kept set is ever drawn
    keep = p * N_SAMPLES >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep], p[~keep].sum()) * N_SAMPLES
    exp, obs = exp[exp > 0], obs[exp > 0]
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA


@pytest.mark.parametrize(
    "kw",
    [
        {"temp": 1.0, "top_k": 5},
        {"temp": 0.7, "top_p": 0.9},
        {"temp": 0.8, "min_p": 0.1},
        {"temp": 1.3, "top_p": 0.5, "top_k": 20, "min_p": 0.02},
    ],
)
def test_masks_act_on_each_row_as_on_one_row(kw):
    """The loop masks a tree's (N, V) rows at once (TreeVerifier.judge); the exact
    distribution of the chi-square tests is one sequential (1, V) row: the same mask, row
    by row (what the top_k=5 chi-square setting checked beside T=0.7,top_p=0.9's)."""
    mx.random.seed(7)
    logits = mx.random.normal((6, 50)) * mx.array([0.5, 1.0, 2.0, 3.0, 4.0, 8.0])[:, None]
    logprobs = log_softmax(logits)
    sp = SamplingParams(**kw)
    rows, dist = np.array(sp.mask(logprobs)), np.array(sp.distribution(logprobs))
    for i in range(logprobs.shape[0]):
        one = logprobs[i : i + 1]
        np.testing.assert_array_equal(rows[i], np.array(sp.mask(one))[0])
        np.testing.assert_allclose(dist[i], np.array(sp.distribution(one))[0], rtol=1e-6, atol=1e-9)
    assert len({tuple(np.flatnonzero(np.isfinite(r))) for r in rows}) > 1  # each row keeps its own tokens


def test_processors_see_each_nodes_own_history():
    mx.random.seed(0)
    logits = mx.random.normal((5, 40))
    tree = parse_tree("0;1;0,0;0,0,0", 3)
    node_tokens = mx.array([3, 7, 9, 7, 12], dtype=mx.int32)
    history = mx.array([1, 2, 3], dtype=mx.int32)
    procs = make_logits_processors(logit_bias={4: 2.0}, repetition_penalty=1.7)
    got = process_logits(
        procs, history, node_tokens, [mx.array(p, dtype=mx.int32) for p in tree.paths], logits
    )
    for i, path in enumerate(tree.paths):
        hist = [1, 2, 3] + [int(node_tokens[j]) for j in path]
        row = logits[i : i + 1]
        for proc in procs:
            row = proc(mx.array(hist), row)
        assert np.allclose(np.array(got[i]), np.array(row[0]))
    # node 2 (token 9, a sibling of node 1) penalises 9, node 1 does not; node 4 (path 7, 7, 12)
    # penalises 12, its parent node 3 does not
    assert float(got[2, 9]) != float(logits[2, 9]) and float(got[1, 9]) == float(logits[1, 9])
    assert float(got[4, 12]) != float(logits[4, 12]) and float(got[3, 12]) == float(logits[3, 12])


@pytest.mark.parametrize("tree", ["0;1;0,0;0,1", "chain:3"])
def test_greedy_identity_with_every_processor(spread, tree):
    model, tok, _ = spread
    model.heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=3)
    procs = make_logits_processors(
        logit_bias={5: 3.0, 17: -2.0}, repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2
    )
    for prompt in ["The quick brown fox", "0123 café"]:
        ids = tok.encode(prompt)
        ref = mlx_lm_greedy(model.backbone, tok, ids, 40, logits_processors=procs)
        assert ref != mlx_lm_greedy(model.backbone, tok, ids, 40)  # the processors matter here
        for drafter in (None, SelfDrafter(model, parse_tree(tree, 3))):
            got, _ = ours(
                model,
                tok,
                ids,
                40,
                tree=tree,
                drafter=drafter,
                logits_processors=procs,
                top_k=3,
                top_p=0.5,
                min_p=0.2,
            )  # filters do nothing when greedy
            assert got == ref


def test_logprobs_equal_plain_decoding(spread):
    model, tok, _ = spread
    model.heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=3)
    procs = make_logits_processors(repetition_penalty=1.3)
    ids = tok.encode("The quick brown fox")
    ref_lp = []
    ref = mlx_lm_greedy(model.backbone, tok, ids, 30, logits_processors=procs, logprobs=ref_lp)
    drafter = SelfDrafter(model, parse_tree("0;1;0,0", 2))
    got, rs = ours(model, tok, ids, 30, drafter=drafter, logits_processors=procs)
    lps = [x for r in rs for x in r.logprobs]
    assert got == ref and sum(r.accepted for r in rs) > 5
    np.testing.assert_allclose(lps, ref_lp, atol=1e-4)

    # sampled: each emitted token's log-probability under a sequential forward
    got, rs = ours(model, tok, ids, 30, drafter=drafter, logits_processors=procs, temp=1.0, top_p=0.8, seed=3)
    lps = [x for r in rs for x in r.logprobs]
    assert len(lps) == len(got) and sum(r.accepted for r in rs) > 3
    seq = ids + got
    logits = model.backbone(mx.array(seq)[None])[0]
    for k, t in enumerate(got):
        row = logits[len(ids) + k - 1][None]
        for proc in procs:
            row = proc(mx.array(seq[: len(ids) + k]), row)
        assert lps[k] == pytest.approx(float(log_softmax(row)[0, t]), abs=1e-4)


@pytest.mark.parametrize(
    "kw", [{"temp": 1.0}, {"temp": 0.7, "top_p": 0.9}, {"temp": 1.0, "top_k": 5, "min_p": 0.05}]
)
def test_seeded_speculative_output_is_plain_output(spread, kw):
    """Uniforms keyed by (seed, position): whatever is drafted, a seeded run emits the
    tokens plain decoding emits with that seed (drafts accepted, tokens identical)."""
    model, tok, ids = spread
    procs = make_logits_processors(repetition_penalty=1.2)
    model.heads = new_heads(model.backbone, tok, 2, scale=0.5, seed=1)
    accepted = 0
    try:
        for seed in range(12):
            plain, _ = ours(model, tok, ids, 24, seed=seed, logits_processors=procs, tree="none", **kw)
            spec, rs = ours(
                model,
                tok,
                ids,
                24,
                seed=seed,
                logits_processors=procs,
                drafter=SelfDrafter(model, parse_tree(TREE, 2)),
                **kw,
            )
            heads, _ = ours(model, tok, ids, 24, seed=seed, logits_processors=procs, tree="0;1;0,0", **kw)
            budget, _ = ours(model, tok, ids, 24, seed=seed, logits_processors=procs, tree="budget", **kw)
            assert spec == plain == heads == budget, seed
            accepted += sum(r.accepted for r in rs)
    finally:
        model.heads = None
    assert accepted > 24


def test_seeded_runs_repeat_whatever_else_runs(spread):
    model, tok, ids = spread
    drafter = SelfDrafter(model, parse_tree(TREE, 2))
    kw = {"temp": 1.0, "top_k": 20, "drafter": drafter}
    a, _ = ours(model, tok, ids, 40, seed=11, **kw)
    # the same seed, interleaved with another seeded generation and global RNG use
    g1 = stream_generate(model, tok, ids, max_tokens=40, seed=11, **kw)
    g2 = stream_generate(model, tok, ids, max_tokens=40, seed=12, **kw)
    b, c = [], []
    for r1, r2 in itertools.zip_longest(g1, g2):
        mx.random.uniform(shape=(3,))
        np.random.random()
        b += r1.tokens if r1 else []
        c += r2.tokens if r2 else []
    assert a == b and a != c


def test_bad_sampling_parameters_are_refused(tiny):
    model, tok = tiny
    for kw, msg in [
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 10_000}, "vocabulary"),
        ({"min_p": 2.0}, "min_p"),
        ({"temp": float("nan")}, "temp"),
        ({"min_tokens_to_keep": 0}, "min_tokens_to_keep"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ]:
        with pytest.raises(ValueError, match=msg):
            next(stream_generate(model, tok, "hi", max_tokens=5, **({"temp": 1.0} | kw)))


class CoupledSelfDrafter:
    """Drafts the target's own chain with the loop's noise: at depth d the argmax of the
    model's logits over the temperature plus the Gumbel noise of that position (q = p)."""

    capture = None
    coupled = True

    def __init__(self, model, depth):
        self.model, self.tree = model, parse_tree(f"chain:{depth}", depth)

    def draft(self, hidden, tokens, mid=None, cache=None, noise=None):
        ctx = list(tokens)
        for d in range(1, self.tree.size):
            logits = self.model.backbone(mx.array(ctx)[None])[0, -1]
            scores = logits if noise is None else noise.perturb(logits, d)
            ctx.append(int(mx.argmax(scores)))
        return mx.array(ctx[len(tokens) :], dtype=mx.int32)


@pytest.mark.parametrize("temp", [1.0, 1.5])
def test_drafts_coupled_to_the_noise_are_accepted_when_q_is_p(spread, temp):
    """With the target's own distribution as the proposal, a coupled draft is the target's
    draw: nearly every draft is accepted (an uncoupled one-hot draft of the same chain is
    accepted only with the target's probability of it), and the output is plain decoding's."""
    model, tok, ids = spread
    coupled = CoupledSelfDrafter(model, 3)
    acc = {}
    for name, drafter in (
        ("coupled", coupled),
        ("greedy chain", SelfDrafter(model, parse_tree("chain:3", 3))),
    ):
        drafted = accepted = 0
        for seed in range(4):
            plain, _ = ours(model, tok, ids, 24, temp=temp, seed=seed)
            got, rs = ours(model, tok, ids, 24, temp=temp, seed=seed, drafter=drafter)
            assert got == plain, (name, seed)
            drafted += sum(r.drafted for r in rs[1:])
            accepted += sum(r.accepted for r in rs)
        acc[name] = accepted / drafted
    print(acc)
    assert acc["coupled"] > 0.95 and acc["greedy chain"] < 0.9
