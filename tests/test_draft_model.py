"""A separate draft model (issue 37, first step): lossless greedy and seeded sampled output,
its own KV cache kept equal to the accepted tokens, and the tokenizer check."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import make_tiny_model_dir


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from mlx_stream import load

    root = tmp_path_factory.mktemp("draft")
    target, tok = load(str(make_tiny_model_dir(root / "t", embed_scale=0.26)), heads=None, dtype="float32")
    other, dtok = load(
        str(make_tiny_model_dir(root / "d", seed=1, embed_scale=0.26)), heads=None, dtype="float32"
    )
    return target, tok, other, dtok


def _run(target, tok, **kw):
    from mlx_stream import stream_generate

    out, last = [], None
    for r in stream_generate(target, tok, "The quick brown", max_tokens=32, **kw):
        out += r.tokens
        last = r
    return out, last


@pytest.mark.parametrize("width,budget,depth", [(1, 4, 3), (2, 8, 4)])
def test_draft_model_output_equals_plain(pair, width, budget, depth):
    from mlx_stream.draft_model import DraftCache, DraftModel, DraftModelDrafter, check_draft_tokenizer

    target, tok, other, dtok = pair
    vocab = check_draft_tokenizer(tok, dtok, target.args.vocab_size, other.args.vocab_size)
    for draft, min_tau in ((target, depth + 0.5), (other, 1.0)):  # itself: near K + 1 tokens a pass
        plain, _ = _run(target, tok)
        dc = DraftCache(DraftModel(draft.backbone, vocab))
        got, last = _run(target, tok, drafter=DraftModelDrafter(dc, budget, width, depth))
        assert got == plain
        if draft is target and width == 1:
            assert last.tau >= min_tau
        for seed in range(3):
            ref, _ = _run(target, tok, temp=1.0, seed=seed)
            dc = DraftCache(DraftModel(draft.backbone, vocab))
            got, _ = _run(
                target, tok, temp=1.0, seed=seed, drafter=DraftModelDrafter(dc, budget, width, depth)
            )
            assert got == ref


def test_draft_cache_matches_a_fresh_prefill(pair):
    from mlx_stream.draft_model import DraftCache, DraftModel

    target, tok, other, _ = pair
    dm = DraftModel(other.backbone, target.args.vocab_size)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)
    dc = DraftCache(dm)
    dc.sync(ids[:8])
    # speculative entries written and dropped, then accepted, rejected and extended contexts
    dc.forward(
        mx.array(ids[8:11], dtype=mx.int32),
        mx.array([8, 9, 10], dtype=mx.int32),
        mx.ones((3, 11), dtype=mx.bool_),
    )
    dc.rewind()
    for ctx in (ids[:11], ids[:9] + [ids[2]], ids[:12]):
        got = dc.sync(ctx)
        fresh = DraftCache(dm).sync(ctx)
        assert dc.layers[0].offset == len(ctx)
        assert mx.allclose(got, fresh, atol=1e-4).item()


def test_a_draft_with_another_tokenizer_is_refused(pair, tmp_path):
    from mlx_stream import load
    from mlx_stream.draft_model import check_draft_tokenizer

    target, tok, _, _ = pair
    small, stok = load(str(make_tiny_model_dir(tmp_path / "s", vocab=300)), heads=None, dtype="float32")
    with pytest.raises(ValueError, match="differs from the target's at token id"):
        check_draft_tokenizer(tok, stok, target.args.vocab_size, small.args.vocab_size)
