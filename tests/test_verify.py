import numpy as np

from mlx_stream.tree import build_tree, chain
from mlx_stream.verify import verify_greedy, verify_sample


def test_greedy_follows_matching_children():
    t = build_tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    # nodes: 0 root, 1=(0,), 2=(1,), 3=(0,0), 4=(1,0), 5=(0,0,0)
    tokens = [7, 10, 11, 12, 13, 14]
    # root wants 11 -> node 2; node 2 wants 13 -> node 4; node 4 wants 99 (no child)
    targets = [11, 0, 13, 0, 99, 0]
    assert verify_greedy(t, tokens, targets) == ([0, 2, 4], 99)
    # nothing accepted: the next token is the root's argmax
    assert verify_greedy(t, tokens, [42, 0, 0, 0, 0, 0]) == ([0], 42)
    # the whole chain accepted: bonus token from the deepest node
    c = chain(3)
    assert verify_greedy(c, [1, 2, 3, 4], [2, 3, 4, 5]) == ([0, 1, 2, 3], 5)


def test_sample_accepts_certain_drafts_and_rejects_impossible():
    t = chain(2)
    rng = np.random.default_rng(0)
    V = 5
    probs = np.zeros((3, V))
    probs[0, 2] = 1.0  # root surely emits 2 (drafted at node 1)
    probs[1, 4] = 1.0  # node 1 surely emits 4, but node 2 drafted 3
    probs[2, 0] = 1.0
    path, nxt = verify_sample(t, [9, 2, 3], probs, rng)
    assert path == [0, 1] and nxt == 4


def test_sample_first_token_distribution_is_exact():
    """With two drafted children, the emitted first token follows p exactly."""
    t = build_tree([(0,), (1,)])
    p = np.array([0.5, 0.3, 0.15, 0.05])
    probs = np.stack([p, p, p])
    rng = np.random.default_rng(1)
    n = 40000
    counts = np.zeros(4)
    for _ in range(n):
        path, nxt = verify_sample(t, [0, 1, 0], probs, rng)  # children draft tokens 1 and 0
        first = [0, 1, 0][path[1]] if len(path) > 1 else nxt
        counts[first] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, chi2)  # chi-square, 3 dof, p = 0.001


def test_stochastic_drafts_keep_the_distribution():
    """Three siblings drawn i.i.d. from q != p (repeats allowed): accept with
    min(1, p/q), residual norm(max(0, p - q)) after each rejection; the emitted first
    token still follows p."""
    from scipy.stats import chisquare

    t = build_tree([(0,), (1,), (2,)])
    p = np.array([0.05, 0.4, 0.3, 0.2, 0.05])
    q = np.array([0.5, 0.1, 0.1, 0.1, 0.2])
    rng = np.random.default_rng(2)
    n = 40000
    counts = np.zeros(5)
    for _ in range(n):
        drafts = rng.choice(5, size=3, p=q)
        toks = [0, *drafts]
        path, nxt = verify_sample(t, toks, np.stack([p] * 4), rng, draft_probs=np.stack([q] * 4))
        counts[toks[path[1]] if len(path) > 1 else nxt] += 1
    assert chisquare(counts, p * n).pvalue > 0.01, counts
    # the residual matters: without it (rejected siblings drawn from p again) the test fails
    naive = np.zeros(5)
    for _ in range(n // 4):
        drafts = rng.choice(5, size=3, p=q)
        ok = [d for d in drafts if rng.random() < min(1.0, p[d] / q[d])]
        naive[ok[0] if ok else rng.choice(5, p=p)] += 1
    assert chisquare(naive, p * n / 4).pvalue < 0.01


def test_coupled_rule_has_the_residual_rules_law():
    """verify_coupled with fresh uniforms: the first emitted token follows p, and which
    child is accepted has verify_sample's probabilities (p(c1), then the residual's)."""
    from scipy.stats import chisquare

    from mlx_stream.verify import verify_coupled

    t = build_tree([(0,), (1,), (0, 0)])
    p = np.array([0.1, 0.5, 0.3, 0.1])
    probs = np.stack([p, [0, 0, 0, 1.0], p, p])
    rng = np.random.default_rng(3)
    n = 40000
    first, accepted = np.zeros(4), np.zeros(3)
    for _ in range(n):
        path, nxt = verify_coupled(t, [0, 1, 2, 3], probs, rng.random(3))
        first[[0, 1, 2, 3][path[1]] if len(path) > 1 else nxt] += 1
        accepted[path[1] if len(path) > 1 else 0] += 1
        if len(path) > 1 and path[1] == 1:  # node 1's target surely emits 3, drafted at node 3
            assert path == [0, 1, 3]
    assert chisquare(first, p * n).pvalue > 0.01
    # child 1 (token 1) w.p. 0.5, child 2 (token 2) w.p. 0.5 * 0.3 / 0.5, none otherwise
    assert chisquare(accepted, np.array([0.2, 0.5, 0.3]) * n).pvalue > 0.01


def test_sample_index_never_draws_zero_weight():
    from mlx_stream.verify import sample_index

    p = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    assert sample_index(p, 0.0) == 1 and sample_index(p, 0.2499) == 1
    assert sample_index(p, 0.25) == 3 and sample_index(p, 0.999999) == 3
    assert sample_index(p, np.nextafter(1.0, 0)) == 3
