"""Head training on the tiny model: label offsets, frozen backbone, gradients, resume."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_stream.heads import load_heads, new_heads
from mlx_stream.train import (
    TrainConfig,
    build_features_from_ids,
    implied_tau,
    load_features,
    stream_loss,
    targets_for,
    train_heads,
)
from mlx_stream.train.data import split, to_example
from mlx_stream.train.loss import head_weights

K = 3
CYCLE = [11, 42, 97, 150, 203, 260, 311]  # distinct tokens: h_t determines every future token


def test_targets_offsets():
    t = targets_for([10, 11, 12, 13, 14, 15], start=2, num_heads=2)
    # positions t = 1..4; row t holds ids[t+1], ids[t+2], ids[t+3]
    assert t.tolist() == [[12, 13, 14], [13, 14, 15], [14, 15, -1], [15, -1, -1]]


def test_implied_tau():
    ranks = np.array([[0, 0, 0], [0, 1, 0], [1, 0, -1], [-1, 0, 0]])
    assert implied_tau(ranks, [(0,), (0, 0), (0, 0, 0)]) == 1 + (3 + 1 + 0 + 0) / 4
    assert implied_tau(ranks, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]) == 1 + (3 + 2 + 2 + 0) / 4


def test_bad_dataset_lines_are_named(tmp_path):
    from mlx_stream.train.data import read_jsonl

    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a"}\n{bad json\n')
    with pytest.raises(ValueError, match="d.jsonl:2: not valid JSON"):
        read_jsonl(f)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_data_formats_and_split():
    assert to_example(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ) == {"prompt": [{"role": "user", "content": "q"}], "completion": "a"}
    assert to_example({"prompt": "p", "completion": "c"}) == {"prompt": "p", "completion": "c"}
    assert to_example({"text": "t"}) == {"prompt": "", "completion": "t"}
    with pytest.raises(ValueError, match="expected"):
        to_example({"foo": 1})
    tr, va = split([{"i": i} for i in range(10)], 0.2, seed=0)
    assert len(tr) == 8 and len(va) == 2 and split([{"i": i} for i in range(10)], 0.2, seed=0) == (tr, va)


def _cycle_features(model, tmp_path, name="f"):
    # a deterministic sequence: a cycle of 7 distinct tokens, so h_t determines every future token
    seqs = [((CYCLE * 12)[s : s + 60], 1) for s in range(7)]
    return build_features_from_ids(model, seqs, tmp_path / name, K, dtype="float32")


@pytest.mark.parametrize("arch,kl", [("residual", 0.0), ("hydra", 0.0), ("hydra", 0.5)])
def test_each_head_learns_its_own_offset(tiny, tmp_path, arch, kl):
    model, tok = tiny
    feats = _cycle_features(model, tmp_path)
    heads = new_heads(model.backbone, tok, K, architecture=arch)
    cfg = TrainConfig(
        num_heads=K, epochs=60, batch_size=64, lr=3e-3, warmup=10, checkpoint_every=0, kl_weight=kl
    )
    report = train_heads(model, heads, feats, tmp_path / "run", cfg, valid=feats, progress=False)
    # (the KL term pulls toward the random tiny backbone's own distribution, so a little less)
    assert min(report["valid"]["top1"]) > (0.97 if kl == 0 else 0.9), report["valid"]
    # the offsets, checked without the training code's targets: head j at t -> x[t+1+j]
    seq = (CYCLE * 12)[3:63]
    hidden, _ = model.family.prefill_hidden(model.backbone, mx.array(seq), make_prompt_cache(model.backbone))
    # hydra heads read the true path x[t+1..t+K] (teacher forcing); residual heads ignore it
    path = np.array([[(seq + [0] * K)[t + i] for i in range(1, K + 1)] for t in range(len(seq))])
    emb = model.embed(mx.array(path)) if arch == "hydra" else None
    pred = np.array(mx.argmax(model.project(heads(hidden, emb)), axis=-1))  # (K, L)
    for j in range(1, K + 1):
        t = np.arange(len(seq) - 1 - j)
        assert (pred[j - 1, t] == np.array(seq)[t + 1 + j]).mean() > (0.97 if kl == 0 else 0.9), j
    # and the heads folder loads back with the fingerprint check
    load_heads(tmp_path / "run" / "heads", heads.config.fingerprint)


@pytest.mark.parametrize("arch", ["residual", "hydra"])
def test_backbone_frozen_and_every_head_gets_gradient(tiny, tmp_path, arch):
    model, tok = tiny
    feats = _cycle_features(model, tmp_path)
    before = {k: np.array(v) for k, v in tree_flatten(model.backbone.parameters())}
    heads = new_heads(model.backbone, tok, K, architecture=arch)
    import mlx.nn as nn

    h, t = mx.array(np.asarray(feats.hidden[:32])), mx.array(np.asarray(feats.targets[:32]))
    _, grads = nn.value_and_grad(
        heads, lambda a, b: stream_loss(model, heads, a, b, head_weights(K), path=b[:, :K])
    )(h, t)
    out_weight = "linear.weight" if arch == "residual" else "out.weight"
    for j in range(K):
        g = dict(tree_flatten(grads))[f"heads.{j}.0.{out_weight}"]
        assert float(mx.abs(g).max()) > 0, f"head {j + 1} receives no gradient"
    cfg = TrainConfig(num_heads=K, epochs=3, batch_size=32, checkpoint_every=0)
    train_heads(model, heads, feats, tmp_path / "run", cfg, progress=False)
    after = dict(tree_flatten(model.backbone.parameters()))
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert np.array_equal(v, np.array(after[k])), k


@pytest.mark.slow  # a training run SIGKILLed and resumed (make test-all)
def test_resume_after_kill_matches_uninterrupted(tiny, tmp_path):
    model, tok = tiny
    feats = _cycle_features(model, tmp_path)
    cfg = TrainConfig(num_heads=K, epochs=8, batch_size=32, lr=2e-3, warmup=3, checkpoint_every=4, seed=5)
    full = new_heads(model.backbone, tok, K)
    train_heads(model, full, feats, tmp_path / "a", cfg, progress=False)
    part = new_heads(model.backbone, tok, K)
    assert train_heads(model, part, feats, tmp_path / "b", cfg, progress=False, stop_after=6) is None
    assert (tmp_path / "b" / "checkpoint").is_dir() and not (tmp_path / "b" / "heads").exists()
    fresh = new_heads(model.backbone, tok, K)  # a new process: nothing in memory
    train_heads(model, fresh, feats, tmp_path / "b", cfg, progress=False, resume=True)
    a = dict(tree_flatten(load_heads(tmp_path / "a" / "heads").parameters()))
    b = dict(tree_flatten(load_heads(tmp_path / "b" / "heads").parameters()))
    for k in a:
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), atol=1e-6)
    assert not (tmp_path / "b" / "checkpoint").exists()


def test_feature_cache_roundtrip_and_errors(tiny, tmp_path):
    model, _ = tiny
    feats = _cycle_features(model, tmp_path)
    again = load_features(tmp_path / "f")
    assert len(again) == len(feats) == 7 * 59 and again.num_heads == K
    (tmp_path / "f" / "targets.npy").unlink()
    with pytest.raises(FileNotFoundError, match="targets.npy"):
        load_features(tmp_path / "f")


def test_reduced_draft_vocab_learns_and_drafts(tiny, tmp_path):
    """Heads scoring only the cycle's tokens learn the offsets and draft real token ids."""
    from mlx_stream import HeadsDrafter
    from mlx_stream.tree import chain

    model, tok = tiny
    feats = _cycle_features(model, tmp_path)
    ids = mx.array(sorted(CYCLE + [5, 6, 7]), dtype=mx.int32)
    heads = new_heads(model.backbone, tok, K, draft_ids=ids)
    cfg = TrainConfig(num_heads=K, epochs=60, batch_size=64, lr=3e-3, warmup=10, checkpoint_every=0)
    report = train_heads(model, heads, feats, tmp_path / "run", cfg, valid=feats, progress=False)
    assert min(report["valid"]["top1"]) > 0.97 and report["draft_vocab_size"] == 10
    loaded = load_heads(tmp_path / "run" / "heads", heads.config.fingerprint)
    assert np.array(loaded.draft_ids).tolist() == np.array(ids).tolist()
    model.heads = loaded
    d = HeadsDrafter(model, chain(K))
    seq = (CYCLE * 3)[:10]
    h = model.family.prefill_hidden(model.backbone, mx.array(seq), make_prompt_cache(model.backbone))[0][-1]
    assert np.array(d.draft(h, seq)).tolist() == (CYCLE * 3)[11:14]


def test_hydra_drafter_conditions_each_child_on_its_own_path(tiny):
    """Tree node (1, 0) is head 2's top-1 after the rank-1 token of depth 1, not after
    the rank-0 token: each subtree is drafted from its own path."""
    from mlx_stream import HeadsDrafter
    from mlx_stream.tree import sparse

    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, K, scale=0.5, seed=4, architecture="hydra")
    tree = sparse(K)
    seq = tok.encode("drafting along a path")
    h = model.family.prefill_hidden(model.backbone, mx.array(seq), make_prompt_cache(model.backbone))[0][-1]
    got = np.array(HeadsDrafter(model, tree).draft(h, seq))
    node = {c: int(got[i]) for i, c in enumerate(tree.choices)}
    heads, emb = model.heads, model.embed
    s1 = heads.step(1, h[None], emb(mx.array([seq[-1]])))
    top1 = np.argsort(-np.array(model.project(s1))[0])
    assert [node[(0,)], node[(1,)]] == top1[:2].tolist()
    want = [int(mx.argmax(model.project(heads.step(2, s1, emb(mx.array([node[(r,)]]))))[0])) for r in (0, 1)]
    assert want[0] != want[1], "the test needs heads whose depth-2 choice depends on the path"
    assert [node[(0, 0)], node[(1, 0)]] == want


def test_batched_generation_is_plain_greedy_and_keeps_the_hidden_states(tiny):
    """Continuous batching (batch 2 over 5 prompts forces refills and row drops) gives
    mlx-lm's greedy tokens, and the kept hidden states are the prefill's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import assert_greedy_identical, mlx_lm_greedy

    from mlx_stream.train.generation import generate_batch

    model, tok = tiny
    prompts = [tok.encode(p) for p in ["The quick brown fox", "a", "heads, trees! 0123", "café", "drafts"]]
    eos = tok.eos_token_ids
    out = dict(generate_batch(model, prompts, 20, eos_ids=eos, keep_hidden=True, batch_size=2))
    assert sorted(out) == list(range(5))
    for i, ids in enumerate(prompts):
        g = out[i]
        ref = mlx_lm_greedy(model, tok, ids, 20)
        assert_greedy_identical(model, ids, [t for t in g.tokens if t not in eos], ref)
        assert g.finish_reason == ("stop" if g.tokens[-1] in eos else "length")
        seq = ids + g.tokens
        h, _ = model.family.prefill_hidden(model.backbone, mx.array(seq), make_prompt_cache(model.backbone))
        np.testing.assert_allclose(
            g.hidden.astype(np.float32), np.array(h[len(ids) - 1 : len(seq) - 1]), atol=2e-2, rtol=1e-2
        )  # float16 storage
    with pytest.raises(ValueError, match="at least one token"):
        list(generate_batch(model, [[]], 4))


def test_feature_writer_resumes_after_a_kill(tmp_path):
    from mlx_stream.train.features import FeatureWriter

    rng = np.random.default_rng(0)
    seqs = [
        (rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 9, size=(n, 3)).astype(np.int32))
        for n in (3, 5, 2)
    ]
    w = FeatureWriter(tmp_path / "f", 4, 2, dtype="float32")
    for i, (h, t) in enumerate(seqs[:2]):
        w.add(h, t, {"index": i})
    # killed while writing the third sequence: hidden and row bytes written, no length
    w._files["hidden.bin"].write(seqs[2][0].tobytes()[:20])
    w._files["rows.jsonl"].write(b'{"ind')
    w.close()
    assert not (tmp_path / "f").exists()
    w = FeatureWriter(tmp_path / "f", 4, 2, dtype="float32", resume=True)
    assert w.sequences == 2 and w.rows == [{"index": 0}, {"index": 1}]
    w.add(*seqs[2], {"index": 2})
    feats = w.finish()
    assert len(feats) == 10 and feats.meta["sequences"] == 3 and not (tmp_path / "f.partial").exists()
    np.testing.assert_array_equal(np.asarray(feats.hidden), np.concatenate([h for h, _ in seqs]))
    np.testing.assert_array_equal(np.asarray(feats.targets), np.concatenate([t for _, t in seqs]))
    with pytest.raises(ValueError, match="delete it to rebuild"):
        FeatureWriter(tmp_path / "g", 4, 2, dtype="float32").close()
        FeatureWriter(tmp_path / "g", 8, 2, dtype="float32", resume=True)


def test_feature_rows_keep_unicode_line_separators_inside_their_text(tmp_path):
    # a completion may hold U+2028 / U+0085 (json.dumps leaves them raw): still one row each,
    # on resume and when a finished cache is appended to another
    from mlx_stream.train.features import FeatureWriter, load_features

    rows = [{"index": 0, "completion": "a\u2028b\x85c"}, {"index": 1, "completion": "d\u2029e\x1cf"}]
    w = FeatureWriter(tmp_path / "f", 4, 2, dtype="float32")
    w.add(np.ones((2, 4), np.float32), np.zeros((2, 3), np.int32), rows[0])
    w.close()
    w = FeatureWriter(tmp_path / "f", 4, 2, dtype="float32", resume=True)
    assert w.rows == rows[:1]
    w.add(np.ones((3, 4), np.float32), np.zeros((3, 3), np.int32), rows[1])
    w.finish(keep_rows=True)
    merged = FeatureWriter(tmp_path / "g", 4, 2, dtype="float32")
    merged.extend(load_features(tmp_path / "f"))
    assert merged.rows == rows and len(merged.finish()) == 5


def test_kl_term_uses_the_backbone_distribution_at_t_plus_j(tiny):
    """With heads that reproduce the backbone's state at t+j exactly, the KL term is 0;
    with other heads it is positive."""
    from mlx_stream.train.loss import stream_loss

    model, tok = tiny
    heads = new_heads(model.backbone, tok, 1)  # zero-init residual: q_1 = p(. | h_t)
    h = mx.random.normal((6, model.args.hidden_size))
    t = mx.array([[1, 2]] * 6, dtype=mx.int32)
    w = head_weights(1)
    base, _ = stream_loss(model, heads, h, t, w)
    same, _ = stream_loss(model, heads, h, t, w, teacher=h[:, None], kl_weight=1.0)
    other, _ = stream_loss(
        model, heads, h, t, w, teacher=mx.random.normal((6, 1, model.args.hidden_size)), kl_weight=1.0
    )
    assert abs(float(same) - float(base)) < 1e-4 and float(other) > float(base) + 1e-3


@pytest.mark.parametrize("copies", [False, True])
def test_msa_heads_learn_their_offsets_on_whole_sequences(tiny, copies):
    """Multi-stream attention heads (frozen layers with adapters, or trainable stream
    layers) train on sequence batches; each stream reaches its own offset, and the
    frozen backbone is untouched."""
    from mlx_stream.train.streams import StreamSequence, stream_ranks, train_stream_heads

    model, tok = tiny
    before = {k: np.array(v) for k, v in tree_flatten(model.backbone.parameters())}
    heads = new_heads(
        model.backbone, tok, K, architecture="msa", stream_layers=1, adapter_size=32, stream_copies=copies
    )
    n = len(model.backbone.layers)
    seqs = []
    for s in range(7):
        ids = (CYCLE * 12)[s : s + 40]
        _, mid = model.family.prefill_hidden(model.backbone, mx.array(ids), model.make_cache(), capture=n - 1)
        seqs.append(StreamSequence(np.array(ids, np.int32), 3, np.array(mid)))
    rep = train_stream_heads(model, heads, seqs, epochs=40, tokens=80, lr=3e-3, log=None)
    ranks = stream_ranks(model, heads, seqs)
    assert ranks.shape == (sum(40 - 3 for _ in seqs), K)
    assert rep["final_loss"] < 0.5
    for j in range(K):  # rows whose target t+1+j exists
        col = ranks[:, j]
        assert (col[col != -1] == 0).mean() > 0.97 and (col == 0).sum() > 220, (j, col)
    after = dict(tree_flatten(model.backbone.parameters()))
    assert all(np.array_equal(before[k], np.array(after[k])) for k in before)


def test_batched_generation_top_k_is_the_backbone_distribution(tiny):
    """The top-k log-probabilities kept with each generated token are those of the
    backbone's own next-token distribution at that position (descending; the top-1
    id is the greedy token), also when finished rows wait in the batch for a refill."""
    from mlx_stream.train.generation import generate_batch

    model, tok = tiny
    prompts = [
        tok.encode(p) for p in ["The quick brown fox", "a", "heads, trees! 0123", "café", "drafts", "x y"]
    ]
    out = dict(generate_batch(model, prompts, 9, keep_hidden=True, batch_size=4, top_k=5, prefill_chunk=3))
    assert sorted(out) == list(range(len(prompts)))
    for i, ids in enumerate(prompts):
        g = out[i]
        assert g.top_ids.shape == g.top_logprobs.shape == (len(g.tokens), 5)
        assert g.top_ids[:, 0].tolist() == g.tokens  # greedy: the most likely token
        assert np.all(np.diff(g.top_logprobs.astype(np.float32), axis=1) <= 0)
        seq = ids + g.tokens
        h, _ = model.family.prefill_hidden(model.backbone, mx.array(seq), make_prompt_cache(model.backbone))
        logp = np.array(nn.log_softmax(model.family.project(model.backbone, h[len(ids) - 1 : len(seq) - 1])))
        np.testing.assert_allclose(
            g.top_logprobs.astype(np.float32), np.take_along_axis(logp, g.top_ids, axis=1), atol=2e-2
        )
    with pytest.raises(ValueError, match="top_k"):
        list(generate_batch(model, prompts, 2, top_k=model.args.vocab_size + 1))


def test_teacher_forced_features_equal_one_prefill_per_sequence(tiny, tmp_path):
    """Sequences batched with right padding (and split into passes) give the features
    of one unpadded prefill each, top-k included."""
    from mlx_stream.train.features import teacher_forced

    model, _ = tiny
    rng = np.random.default_rng(0)
    seqs = [
        (rng.integers(1, 250, n).tolist(), s)
        for n, s in ((9, 3), (10, 1), (31, 30), (4, 2), (12, 12), (30, 5))
    ]
    got = {i: r for i, *r in teacher_forced(model, seqs, top_k=4, tokens_per_pass=24)}
    assert sorted(got) == [0, 1, 2, 3, 5]  # sequence 4 has no completion positions
    for i, (h, lp, ti) in got.items():
        ids, start = seqs[i]
        ref, _ = model.family.prefill_hidden(model.backbone, mx.array(ids), make_prompt_cache(model.backbone))
        ref = ref[start - 1 : len(ids) - 1]
        np.testing.assert_allclose(h.astype(np.float32), np.array(ref), atol=2e-2, rtol=1e-2)
        logp = np.array(nn.log_softmax(model.family.project(model.backbone, ref)))
        assert ti[:, 0].tolist() == logp.argmax(axis=1).tolist()
        np.testing.assert_allclose(lp.astype(np.float32), np.take_along_axis(logp, ti, axis=1), atol=2e-2)
    feats = build_features_from_ids(model, seqs, tmp_path / "f", K, top_k=4)
    assert feats.top_k == 4 and feats.top_ids.shape == (len(feats), 4)
    assert len(feats) == sum(len(ids) - s for ids, s in seqs)


def test_stored_top_k_soft_targets_equal_the_recomputed_kl(tiny, tmp_path):
    """With k = V the stored soft targets carry the whole distribution, so the loss
    equals the one recomputed from the hidden states at t+j; with a small k it is
    a truncated KL, still zero for heads that match the backbone."""
    model, tok = tiny
    V = model.args.vocab_size
    seqs = [((CYCLE * 12)[s : s + 20], 1) for s in range(3)]
    feats = build_features_from_ids(model, seqs, tmp_path / "f", 1, dtype="float32", top_k=V)
    heads = new_heads(model.backbone, tok, 1)
    rng = np.random.default_rng(1)  # heads that differ from the backbone
    heads.update(
        tree_unflatten(
            [
                (k, mx.array(rng.normal(0, 0.05, v.shape), dtype=mx.float32))
                for k, v in tree_flatten(heads.trainable_parameters())
            ]
        )
    )
    idx = np.array([0, 3, 7, 11])
    h = mx.array(np.asarray(feats.hidden[idx]))
    t = mx.array(np.asarray(feats.targets[idx]))
    w = head_weights(1)
    teacher = mx.array(np.asarray(feats.hidden[idx + 1]))[:, None]
    soft = (
        mx.array(np.asarray(feats.top_logprobs[idx + 1]))[:, None],
        mx.array(np.asarray(feats.top_ids[idx + 1]))[:, None],
    )
    base, _ = stream_loss(model, heads, h, t, w)
    recomputed, _ = stream_loss(model, heads, h, t, w, teacher=teacher, kl_weight=1.0)
    stored, _ = stream_loss(model, heads, h, t, w, kl_weight=1.0, soft=soft)
    assert float(recomputed) > float(base) + 1e-3
    assert abs(float(stored) - float(recomputed)) < 1e-2 * float(recomputed - base)


@pytest.mark.parametrize("kl", [0.0, 1.0])
def test_loss_spread_over_streams_equals_one_stream(tiny, kl):
    """Spreading the heads over several MLX streams (one thread each on a CPU) changes
    where the loss is computed, not its value or gradients."""
    model, tok = tiny
    heads = new_heads(model.backbone, tok, K, architecture="hydra")
    rng = np.random.default_rng(2)
    heads.update(
        tree_unflatten(
            [
                (k, mx.array(rng.normal(0, 0.05, v.shape), dtype=mx.float32))
                for k, v in tree_flatten(heads.trainable_parameters())
            ]
        )
    )
    h = mx.random.normal((5, model.args.hidden_size), key=mx.random.key(0))
    t = mx.array(rng.integers(-1, model.args.vocab_size, (5, K + 1)), dtype=mx.int32)
    teacher = mx.random.normal((5, K, model.args.hidden_size), key=mx.random.key(1))
    w = head_weights(K)

    def grads(streams):
        def f():
            return stream_loss(
                model, heads, h, t, w, path=t[:, :K], teacher=teacher, kl_weight=kl, streams=streams
            )

        (loss, corr), g = nn.value_and_grad(heads, f)()
        return float(loss), np.array(corr), dict(tree_flatten(g))

    one = grads(None)
    many = grads([mx.default_stream(mx.cpu), mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)])
    # (float32 sums in another order: a loss of ~43 differed by 1.1e-5 once, 2.7e-7 relative)
    assert one[0] == pytest.approx(many[0], rel=1e-6) and (one[1] == many[1]).all()
    for k, v in one[2].items():
        np.testing.assert_allclose(np.array(many[2][k]), np.array(v), atol=1e-5)


def test_replay_takes_the_loops_queued_steps_and_lookup_chains(tiny_dir):
    # the loop queues a step over the heads' static tree before the step before is read
    # back unless a prompt-lookup chain may join it; the replay takes the same steps
    from mlx_stream import load
    from mlx_stream.bench import Decoding, decode_items
    from mlx_stream.drafters import LookupDrafter
    from mlx_stream.speculation import make_drafter
    from mlx_stream.train.replay import replay_items

    model, tok = load(str(tiny_dir), dtype="float32")
    model.heads = new_heads(model.backbone, tok, 3, scale=0.1, seed=3)
    assert isinstance(make_drafter(model, "0;0,0", None), LookupDrafter)  # prompt lookup is on
    items = [{"prompt": p, "group": "g", "category": "c"} for p in ("Count:", "ab ab ab", "The quick brown")]
    for tree in ("0", "0;1;0,0"):  # tree 0: the replay without the queued steps made 5 passes, not 6
        got = replay_items(model, tok, items, 40, tree=tree)
        ref = decode_items(model, tok, items, Decoding(40, tree, None))
        assert [(r["tokens"], r["forward_passes"]) for r in got] == [
            (pytest.approx(r["tokens"]), r["forward_passes"]) for r in ref
        ], tree
        assert sum(r["tokens"] for r in got) > 1.3 * sum(r["forward_passes"] for r in got)


def test_replay_sequence_walks_the_tree_as_the_loop_does(tiny):
    from mlx_stream import OracleDrafter
    from mlx_stream.train.replay import replay_sequence
    from mlx_stream.tree import chain

    model, tok = tiny
    V = model.args.vocab_size
    prompt, output = [1, 2, 3], list(range(10, 30))  # 20 tokens: 19 made after the first
    hidden = np.zeros((20, model.args.hidden_size), np.float16)
    ok = OracleDrafter(len(prompt), output, chain(3), V)  # every draft right: 4 tokens a pass
    assert replay_sequence(ok, prompt, output, hidden, 128) == (19, 5)
    wrong = OracleDrafter(len(prompt), output, chain(3), V, wrong=True)
    assert replay_sequence(wrong, prompt, output, hidden, 128) == (19, 19)
    # the budget bounds the depth as in the loop: with max_tokens = 20 the last trees are shallower
    assert replay_sequence(OracleDrafter(len(prompt), output, chain(3), V), prompt, output, hidden, 20) == (
        19,
        5,
    )
