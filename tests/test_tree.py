import numpy as np
import pytest

from mlx_stream.tree import build_tree, chain, no_drafts, parse_tree, sparse


def test_build_tree_structure():
    t = build_tree([(0, 0), (0,), (1,), (0, 1), (0, 0, 0)])
    assert t.choices == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.ranks.tolist() == [0, 0, 1, 0, 1, 0]
    assert t.children == ((1, 2), (3, 4), (), (5,), (), ())
    assert t.topk() == (2, 2, 1)
    # ancestors-only: node 5 = root -> 1 -> 3 -> 5
    assert np.flatnonzero(t.mask[5]).tolist() == [0, 1, 3, 5]
    assert np.flatnonzero(t.mask[2]).tolist() == [0, 2]
    assert not t.mask[3, 2] and not t.mask[1, 3]


def test_truncate_is_prefix():
    t = sparse(4)
    for d in range(0, 5):
        s = t.truncate(d)
        assert s.choices == t.choices[: s.size - 1]
        assert s.size == 1 or s.depth <= d
    assert t.truncate(0).size == 1


def test_presets_and_parse():
    assert chain(3).choices == ((0,), (0, 0), (0, 0, 0))
    assert no_drafts().size == 1
    assert parse_tree("none", 3).size == 1
    assert parse_tree("chain", 3) == chain(3)
    assert parse_tree("chain:2", 3) == chain(2)
    assert parse_tree("0;1;0,0", 3).choices == ((0,), (1,), (0, 0))
    assert parse_tree(None, 3).depth == 3


@pytest.mark.parametrize("bad", ["bogus", "0;;1", "0,a", "chain:x", ""])
def test_parse_rejects_malformed(bad):
    with pytest.raises(ValueError, match="unknown tree"):
        parse_tree(bad, 3)


def test_parse_rejects_too_deep_and_orphans():
    with pytest.raises(ValueError, match="stream heads"):
        parse_tree("chain:4", 3)
    with pytest.raises(ValueError, match="no parent"):
        build_tree([(0, 0)])
    with pytest.raises(ValueError, match="invalid tree path"):
        build_tree([(-1,)])


def test_tree_from_ranks_is_optimal_and_prefix_closed():
    import itertools

    import numpy as np

    from mlx_stream.train.trainer import implied_tau
    from mlx_stream.tree import format_tree, parse_tree, tree_from_ranks

    rng = np.random.default_rng(0)
    ranks = np.minimum(rng.geometric(0.55, size=(400, 3)) - 1, 3)
    ranks[rng.random((400, 3)) < 0.1] = -1
    for size in (1, 3, 5):
        tree, tau = tree_from_ranks(ranks, size)
        assert len(tree.choices) == size and tau == pytest.approx(implied_tau(ranks, tree.choices))
        assert parse_tree(format_tree(tree), 3).choices == tree.choices
        # no prefix-closed tree of that size does better (exhaustive over small paths)
        paths = [c for d in (1, 2, 3) for c in itertools.product(range(3), repeat=d)]
        for cand in itertools.combinations([c for c in paths if len(c) <= 2], size):
            if all(c[:-1] in cand or len(c) == 1 for c in cand):
                assert implied_tau(ranks, cand) <= tau + 1e-12
