"""The datastore of past outputs (mlx_stream/datastore.py) and its chain in the lookup drafter."""

import numpy as np
import pytest

from mlx_stream.datastore import SEP, Datastore


def brute_match(seqs, context, max_ngram, min_ngram):
    # the longest suffix of the context (<= max_ngram) that occurs in some sequence with a continuation
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        suf = list(context[-n:])
        hits = [(i, j) for i, s in enumerate(seqs) for j in range(len(s) - n) if list(s[j : j + n]) == suf]
        if hits:
            return n, hits
    return 0, []


def test_match_finds_the_longest_suffix_and_all_its_occurrences():
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, 6, size=rng.integers(5, 40))) for _ in range(30)]
    store = Datastore.from_sequences(seqs, max_ngram=5)
    assert len(store) == sum(len(s) for s in seqs)
    for _ in range(200):
        ctx = list(rng.integers(0, 6, size=rng.integers(1, 9)))
        n, lo, hi = store.match(ctx, min_ngram=2)
        ref_n, hits = brute_match(seqs, ctx, 5, 2)
        assert n == ref_n
        assert hi - lo == len(hits)


def test_lookup_proposes_the_most_frequent_continuation():
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]
    store = Datastore.from_sequences([a, a, a, b, [7, 8]], max_ngram=4)
    assert store.lookup([0, 1, 2, 3], 3) == [4, 5, 6]  # three of four occurrences
    assert store.lookup([0, 1, 2, 3], 2) == [4, 5]
    assert store.lookup([5, 7, 8], 4) == []  # the sequence ends there: nothing follows
    assert store.lookup([42, 43], 4) == []  # never seen
    assert store.lookup([0, 1, 2, 3], 0) == []
    # a continuation shared by too few of the matches stops the chain
    store = Datastore.from_sequences([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 3, 7]], max_ngram=4)
    assert store.lookup([1, 2, 3], 4) == []


def test_separators_are_never_matched_or_drafted():
    store = Datastore(np.array([1, 2, SEP, 3, 1, 2, SEP], np.int32), max_ngram=3)
    assert store.lookup([2, SEP, 3], 3) == []
    assert store.lookup([1, 2], 3) == []  # both occurrences end at a separator
    with pytest.raises(ValueError, match="max_ngram"):
        Datastore(np.zeros(3, np.int32), max_ngram=0)
    empty = Datastore.from_sequences([])
    assert len(empty) == 0 and empty.lookup([1, 2, 3], 4) == []


def test_the_lookup_drafter_drafts_the_store_where_the_context_has_no_match():
    from mlx_stream.drafters import LookupDrafter, NoDrafter

    store = Datastore.from_sequences([[11, 12, 13, 14, 15, 16]] * 2)  # seen twice: a chain, not one token
    d = LookupDrafter(NoDrafter(), num_draft=3, store=store)
    tree, drafts = d.propose(None, [10, 11, 12], max_depth=8)
    assert tree.size == 4 and drafts.tolist() == [13, 14, 15]
    tree, drafts = d.propose(None, [11, 12, 5, 11, 12], max_depth=8)  # the context's own copy comes first
    assert drafts.tolist()[:1] == [5]
    # the store's chains have their own gate: misses stop them, not the context's copies
    for _ in range(6):
        tree, drafts = d.propose(None, [10, 11, 12], max_depth=8)
        d.observe(tree, [12, *drafts.tolist()], [99])
    assert d.rates["store"] < d.min_accept <= d.rates["context"]


def test_store_chains_keep_decoding_lossless(tiny):
    from helpers import mlx_lm_greedy, ours

    from mlx_stream.speculation import make_drafter

    model, tok = tiny
    for prompt in ("Speculative decoding drafts several tokens", "The quick brown fox"):
        ids = tok.encode(prompt)
        ref = list(mlx_lm_greedy(model.backbone, tok, ids, 40))
        wrong = Datastore.from_sequences([[(t + 1) % 50 for t in ref], ref[::-1]])
        for store in (Datastore.from_sequences([ref]), wrong):
            got, _ = ours(model, tok, ids, 40, drafter=make_drafter(model, "none", 10, store))
            assert got == ref


def test_save_and_load_refuse_another_tokenizer_and_corrupt_files(tmp_path):
    from mlx_stream.datastore import load_store, save_store

    store = Datastore.from_sequences([[1, 2, 3, 4], [1, 2, 3, 4]], max_ngram=3)
    path = save_store(store, tmp_path / "store.npz", "abc123")
    back = load_store(path, "abc123")
    assert np.array_equal(back.tokens, store.tokens) and back.max_ngram == 3
    assert back.lookup([9, 1, 2], 2) == [3, 4]
    with pytest.raises(ValueError, match="tokenizer abc123"):
        load_store(path, "other")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable datastore"):
        load_store(tmp_path / "bad.npz")
    with pytest.raises(FileNotFoundError):
        load_store(tmp_path / "missing.npz")
