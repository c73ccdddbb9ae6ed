import mlx.core as mx
import numpy as np
import pytest

from mlx_stream.cache import TreeKVCache


def _fill(c, start, n):
    k = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 2, n, 3))
    c.update_and_fetch(k, k + 1000)


def test_keep_compacts_the_accepted_path():
    c = TreeKVCache()
    _fill(c, 0, 5)  # prefix of 5
    _fill(c, 5, 6)  # tree of 6 nodes at slots 5..10
    c.keep(5, [0, 2, 5])
    assert c.offset == 8
    k, v = c.keys_and_values()
    assert np.array(k[0, 0, :, 0]).tolist() == [0, 1, 2, 3, 4, 5, 7, 10]
    assert np.array(v[0, 1, :, 2]).tolist() == [1000, 1001, 1002, 1003, 1004, 1005, 1007, 1010]
    # a prefix path needs no copy and just moves the offset
    _fill(c, 8, 3)
    c.keep(8, [0, 1])
    assert c.offset == 10
    assert np.array(c.keys_and_values()[0][0, 0, :, 0]).tolist()[-2:] == [8, 9]


def test_keep_refuses_nodes_past_the_end():
    c = TreeKVCache()
    _fill(c, 0, 3)
    with pytest.raises(ValueError, match="past the cache end"):
        c.keep(1, [0, 5])
