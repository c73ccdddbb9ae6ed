"""Each tree node's logits equal sequential decoding's logits for the same path."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_stream.cache import keep_path, make_tree_cache
from mlx_stream.tree import build_tree, sparse


def _sequential_logits(model, tokens):
    cache = make_prompt_cache(model.backbone)
    return np.array(model.backbone(mx.array(tokens)[None], cache=cache)[0], dtype=np.float32)


@pytest.mark.parametrize("prefix_len", [1, 7, 33])
def test_tree_nodes_match_sequential(tiny, prefix_len):
    model, _ = tiny
    fam, bb = model.family, model.backbone
    rng = np.random.default_rng(prefix_len)
    V = model.args.vocab_size
    prefix = rng.integers(3, V, prefix_len).tolist()
    tree = build_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)])
    node_tokens = rng.integers(3, V, tree.size).tolist()

    cache = make_tree_cache(bb)
    fam.prefill_hidden(bb, mx.array(prefix[:-1]), cache) if prefix_len > 1 else None
    start = cache[0].offset
    # root = last prefix token; positions = offset + depth; ancestors-only mask
    node_tokens[0] = prefix[-1]
    mask = mx.concatenate([mx.ones((tree.size, start), dtype=mx.bool_), mx.array(tree.mask)], axis=1)
    h, _ = fam.tree_hidden(bb, mx.array(node_tokens), mx.array(start + tree.depths), mask, cache)
    logits = np.array(fam.project(bb, h))

    for i in range(tree.size):
        path = [j for j in range(tree.size) if tree.mask[i, j]]
        seq = prefix[:-1] + [node_tokens[j] for j in path]
        ref = _sequential_logits(model, seq)[-1]
        np.testing.assert_allclose(logits[i], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_chain_rotated_from_its_roots_position_is_bitwise_the_per_node_forward(tiny, lazy):
    """The llama family takes a chain's positions as its root's (an int, or a lazy ``()``
    array for a queued step): the same logits, bitwise, as one position per node."""
    from mlx_stream.tree import chain

    model, _ = tiny
    fam, bb = model.family, model.backbone
    assert getattr(fam, "CHAIN_OFFSETS", False)
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, model.args.vocab_size, 12).tolist()
    tree = chain(4)
    nodes = mx.array(rng.integers(3, model.args.vocab_size, tree.size).tolist())
    out = []
    for scalar in (False, True):
        cache = make_tree_cache(bb)
        fam.prefill_hidden(bb, mx.array(prefix), cache)
        start = cache[0].offset
        mask = mx.concatenate([mx.ones((tree.size, start), dtype=mx.bool_), mx.array(tree.mask)], axis=1)
        if not scalar:
            positions = mx.array(start + tree.depths, dtype=mx.int32)
        else:
            positions = mx.array(start - 3, dtype=mx.int32) + 3 if lazy else start
        h, _ = fam.tree_hidden(bb, nodes, positions, mask, cache)
        out.append(np.array(fam.project(bb, h)))
    assert np.array_equal(out[0], out[1])


def test_compacted_cache_continues_like_sequential(tiny):
    """After keeping one path, the next forward sees exactly the emitted prefix."""
    model, _ = tiny
    fam, bb = model.family, model.backbone
    rng = np.random.default_rng(5)
    V = model.args.vocab_size
    prefix = rng.integers(3, V, 9).tolist()
    tree = sparse(3)
    cache = make_tree_cache(bb)
    fam.prefill_hidden(bb, mx.array(prefix[:-1]), cache)
    start = cache[0].offset
    nodes = rng.integers(3, V, tree.size).tolist()
    nodes[0] = prefix[-1]
    mask = mx.concatenate([mx.ones((tree.size, start), dtype=mx.bool_), mx.array(tree.mask)], axis=1)
    fam.tree_hidden(bb, mx.array(nodes), mx.array(start + tree.depths), mask, cache)
    leaf = tree.size - 1
    path = [j for j in range(tree.size) if tree.mask[leaf, j]]
    keep_path(cache, start, path)
    assert cache[0].offset == start + len(path)
    nxt = int(rng.integers(3, V))
    h, _ = fam.tree_hidden(bb, mx.array([nxt]), mx.array([cache[0].offset]), None, cache)
    got = np.array(fam.project(bb, h))[0]
    ref = _sequential_logits(model, prefix[:-1] + [nodes[j] for j in path] + [nxt])[-1]
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
