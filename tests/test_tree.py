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
