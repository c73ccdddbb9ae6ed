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


def test_lookup_over_several_stores_equals_one_store_of_all():
    from mlx_stream.datastore import lookup_many

    rng = np.random.default_rng(1)
    seqs = [list(rng.integers(0, 5, size=rng.integers(3, 30))) for _ in range(40)]
    one = Datastore.from_sequences(seqs, max_ngram=5)
    parts = [Datastore.from_sequences(seqs[:13], 5), Datastore.from_sequences(seqs[13:], 5)]
    hits = 0
    for _ in range(300):
        ctx = list(rng.integers(0, 5, size=rng.integers(2, 9)))
        want = one.lookup(ctx, 4, min_share=0.2, max_matches=10_000)
        assert lookup_many(parts, ctx, 4, min_share=0.2, max_matches=10_000) == want
        hits += bool(want)
    assert hits > 50  # the property was tested on real drafts


def test_keep_latest_keeps_whole_answers():
    from mlx_stream.datastore import keep_latest

    t = np.array([1, 2, SEP, 3, 4, 5, SEP, 6, SEP], np.int32)
    assert keep_latest(t, 100).tolist() == t.tolist()
    assert keep_latest(t, 6).tolist() == [3, 4, 5, SEP, 6, SEP]
    assert keep_latest(t, 5).tolist() == [6, SEP]
    assert keep_latest(t, 1).tolist() == [SEP]


def test_answer_store_appends_bounds_clears_and_sets_a_bad_file_aside(tmp_path):
    from mlx_stream.datastore import AnswerStore

    h = AnswerStore(tmp_path / "h" / "m.npz", "tok1", max_tokens=12)
    assert h.read().tolist() == [] and not h.clear()
    assert h.append([[1, 2, 3], [], [4, 5]]) == 5
    assert h.append([[6, 7, 8, 9]]) == 9
    assert h.read().tolist() == [1, 2, 3, SEP, 4, 5, SEP, 6, 7, 8, 9, SEP]
    assert h.append([[10, 11]]) == 8  # the oldest answer went
    assert h.read().tolist() == [4, 5, SEP, 6, 7, 8, 9, SEP, 10, 11, SEP]
    # another tokenizer's file, then a corrupt one: moved aside with a warning, nothing lost silently
    with pytest.warns(UserWarning, match="tokenizer tok1.*moved aside"):
        assert AnswerStore(h.path, "tok2").read().tolist() == []
    assert not h.path.exists() and len(list(h.path.parent.glob("m.npz.bad-*"))) == 1
    h.path.write_bytes(b"PK\x03\x04 torn")
    with pytest.warns(UserWarning, match="not a readable datastore"):
        assert h.append([[1, 2]]) == 2
    assert h.read().tolist() == [1, 2, SEP] and len(list(h.path.parent.glob("m.npz.bad-*"))) == 2
    np.savez(h.path, tokens=np.array([5, -7], np.int32), tokenizer=np.array("tok1"), max_ngram=np.array(8))
    with pytest.warns(UserWarning, match="ids >= -1"):
        assert h.read().tolist() == []
    assert h.append([[3]]) == 1 and h.clear() and h.read().tolist() == []


def _append_many(path, who, n):
    from mlx_stream.datastore import AnswerStore

    h = AnswerStore(path, "tok")
    for i in range(n):
        h.append([[who, i, who]])


def test_two_processes_appending_at_once_lose_nothing(tmp_path):
    import multiprocessing as mp

    from mlx_stream.datastore import AnswerStore

    path = tmp_path / "m.npz"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(path, who, 40)) for who in (100, 200)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    toks = AnswerStore(path, "tok").read()
    answers = {tuple(a) for a in np.split(toks, np.flatnonzero(toks == SEP) + 1) if len(a)}
    want = {(who, i, who, SEP) for who in (100, 200) for i in range(40)}
    assert answers == want


def test_draft_store_learns_only_when_asked(tmp_path):
    from mlx_stream.datastore import AnswerStore, DraftStore

    shipped = Datastore.from_sequences([[1, 2, 3, 4]] * 2)
    h = AnswerStore(tmp_path / "m.npz", "tok")
    h.append([[7, 8, 9, 10]] * 2)
    ro = DraftStore(shipped, h, learn=False)
    assert ro.lookup([0, 1, 2], 2) == [3, 4] and ro.lookup([5, 7, 8], 2) == [9, 10]
    ro.remember([20, 21, 22, 23])
    assert ro.lookup([20, 21], 2) == [] and len(h.read()) == 10  # read only: nothing added
    rw = DraftStore(shipped, h)
    rw.remember([20, 21, 22, 23])
    rw.remember([20, 21, 22, 23])
    assert rw.lookup([5, 20, 21], 2) == [22, 23]  # this session's answers draft at once
    assert len(AnswerStore(h.path, "tok").read()) == 20  # and joined the file


def test_heads_folder_store_and_answers_reach_decoding(tiny_dir, tmp_path, monkeypatch):
    from helpers import mlx_lm_greedy, ours

    from mlx_stream import load
    from mlx_stream.datastore import STORE_FILE, AnswerStore, answers_path, save_store
    from mlx_stream.heads import backbone_fingerprint, new_heads, save_heads

    monkeypatch.setenv("MLX_STREAM_CACHE", str(tmp_path / "cache"))
    model, tok = load(str(tiny_dir), heads=None, dtype="float32")
    assert model.datastore is None
    fp = backbone_fingerprint(model.backbone, tok)
    ids = tok.encode("The quick brown fox")
    ref = list(mlx_lm_greedy(model.backbone, tok, ids, 40))
    folder = save_heads(
        new_heads(model.backbone, tok, 3, scale=0.5, seed=5, architecture="hydra"), tmp_path / "h"
    )
    save_store(Datastore.from_sequences([[1, 2, 3]] * 2), folder / STORE_FILE, fp["tokenizer"])

    m, _ = load(
        str(tiny_dir), heads=str(folder), dtype="float32"
    )  # the heads' store, not this machine's answers
    assert m.datastore.lookup([0, 1, 2], 1) == [3] and m.datastore.learn is False
    got, _ = ours(m, tok, ids, 40)
    assert got == ref and not (tmp_path / "cache" / "answers").exists()

    m, _ = load(str(tiny_dir), heads=str(folder), dtype="float32", learn=True)
    first, r1 = ours(m, tok, ids, 40)
    again, r2 = ours(m, tok, ids, 40)  # drafts the first answer from the session's store
    assert first == again == ref
    assert r2[-1].forward_passes < r1[-1].forward_passes
    stored = AnswerStore(answers_path(fp, tmp_path / "cache"), fp["tokenizer"]).read()
    assert stored.tolist() == (ref + [SEP]) * 2  # both answers, never the prompt

    m, _ = load(str(tiny_dir), heads=str(folder), dtype="float32", learn="read")  # a later process, read only
    again, r3 = ours(m, tok, ids, 40)
    assert again == ref and r3[-1].forward_passes < r1[-1].forward_passes
    assert len(AnswerStore(answers_path(fp, tmp_path / "cache"), fp["tokenizer"]).read()) == len(stored)

    save_store(Datastore.from_sequences([[1, 2, 3]]), folder / STORE_FILE, "another")
    with pytest.raises(ValueError, match="tokenizer another"):
        load(str(tiny_dir), heads=str(folder), dtype="float32")
    with pytest.raises(ValueError, match="learn must be"):
        load(str(tiny_dir), heads=None, learn="yes")
