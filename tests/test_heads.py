"""Stream heads: zero-init identity, checkpoint format, fingerprint refusal, bad files."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model_dir

from mlx_stream import load
from mlx_stream.heads import HeadConfig, backbone_fingerprint, load_heads, new_heads, save_heads


def test_fresh_heads_predict_the_backbones_next_token(tiny):
    model, tok = tiny
    model.heads = new_heads(model.backbone, tok, 3)
    h = mx.random.normal((model.args.hidden_size,))
    per_head = np.array(model.head_logits(h))
    ref = np.array(model.family.project(model.backbone, h))
    assert per_head.shape == (3, model.args.vocab_size)
    for j in range(3):
        np.testing.assert_allclose(per_head[j], ref, atol=1e-5)


def test_save_load_roundtrip(tiny, tmp_path):
    model, tok = tiny
    heads = new_heads(model.backbone, tok, 4, scale=0.1, seed=9)
    save_heads(heads, tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["config.json", "heads.safetensors"]
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["num_heads"] == 4 and cfg["fingerprint"]["architecture"] == "llama"
    loaded = load_heads(tmp_path / "h", backbone_fingerprint(model.backbone, tok))
    h = mx.random.normal((3, model.args.hidden_size))
    np.testing.assert_array_equal(np.array(loaded(h)), np.array(heads(h)))
    # overwrite in place (atomic rename), no temporary folders left behind
    save_heads(heads, tmp_path / "h")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]


def test_load_attaches_heads_and_refuses_another_backbone(tiny_dir, tmp_path):
    model, tok = load(str(tiny_dir))
    save_heads(new_heads(model.backbone, tok, 2), tmp_path / "heads")
    m2, _ = load(str(tiny_dir), heads=str(tmp_path / "heads"))
    assert m2.heads is not None and m2.heads.num_heads == 2
    other = make_tiny_model_dir(tmp_path / "other", seed=1)
    with pytest.raises(ValueError, match="trained for backbone .* but the loaded backbone is"):
        load(str(other), heads=str(tmp_path / "heads"))


def test_bad_heads_files(tiny, tmp_path):
    model, tok = tiny
    fp = backbone_fingerprint(model.backbone, tok)
    with pytest.raises(FileNotFoundError, match="heads folder not found"):
        load_heads(tmp_path / "missing", fp)
    save_heads(new_heads(model.backbone, tok, 2), tmp_path / "h")
    w = tmp_path / "h" / "heads.safetensors"
    w.write_bytes(w.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match="heads.safetensors"):
        load_heads(tmp_path / "h", fp)
    (tmp_path / "h" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_heads(tmp_path / "h", fp)
    with pytest.raises(ValueError, match="num_heads"):
        HeadConfig(num_heads=0, hidden_size=4, vocab_size=4)


def test_fingerprint_ignores_quantisation(real):
    model, tok = real
    q, qtok = load("smollm2-135m-instruct", heads=None, dtype="quantized")
    assert backbone_fingerprint(q.backbone, qtok) == backbone_fingerprint(model.backbone, tok)


def test_hydra_heads_saved_in_float16_load_as_float32(tiny, tmp_path):
    model, tok = tiny
    heads = new_heads(
        model.backbone,
        tok,
        3,
        scale=0.1,
        seed=2,
        architecture="hydra",
        draft_ids=mx.arange(10, 40, dtype=mx.int32),
    )
    save_heads(heads, tmp_path / "h", dtype=mx.float16)
    stored = mx.load(str(tmp_path / "h" / "heads.safetensors"))
    assert stored["heads.0.0.inp.weight"].dtype == mx.float16 and stored["draft_ids"].dtype == mx.int32
    loaded = load_heads(tmp_path / "h")
    assert loaded.conditioned and loaded.heads[1][0].inp.weight.dtype == mx.float32
    assert np.array(loaded.draft_ids).tolist() == list(range(10, 40))
    h = mx.random.normal((2, model.args.hidden_size))
    path = model.embed(mx.array([[1, 2, 3], [4, 5, 6]]))
    np.testing.assert_allclose(np.array(loaded(h, path)), np.array(heads(h, path)), atol=2e-2, rtol=1e-2)


def _mid_and_kv(model, ids, ns):
    from mlx_lm.models.base import create_attention_mask

    from mlx_stream.models import llama as fam

    inner = model.backbone.model
    x = inner.embed_tokens(ids[None])
    mask = create_attention_mask(x, None)
    for layer in inner.layers[: len(inner.layers) - ns]:
        x = layer(x, mask, None)
    return x, fam.main_stream_kv(model.backbone, x, ns)


@pytest.mark.parametrize("copies", [False, True])
def test_msa_streams_from_the_cache_equal_the_training_pass(tiny, copies):
    """Decoding reads the KV cache at one position; training runs whole sequences with a
    causal mask: the streams must agree, and must not see positions after t (frozen
    layers with adapters, and trainable stream layers)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_stream.models import llama as fam

    model, tok = tiny
    heads = new_heads(
        model.backbone,
        tok,
        3,
        scale=0.2,
        seed=1,
        architecture="msa",
        stream_layers=1,
        adapter_size=8,
        stream_copies=copies,
    )
    model.heads = heads
    ids = mx.array([5, 17, 33, 8, 91, 40, 2, 77])
    T = ids.shape[0]
    x, kv = _mid_and_kv(model, ids, 1)
    ar = mx.arange(T)
    root = mx.concatenate([ids[1:], mx.array([0])])[None]
    seq = fam.stream_hidden(model.backbone, heads, x, ar[None], kv, (ar[None, :] <= ar[:, None])[None], root)
    logits_seq = model.project(heads(seq))  # (K, 1, T, V)
    # a different future must not change the streams at t
    ids2 = mx.concatenate([ids[:6], mx.array([3, 3])])
    x2, kv2 = _mid_and_kv(model, ids2, 1)
    root2 = mx.concatenate([ids2[1:], mx.array([0])])[None]
    seq2 = fam.stream_hidden(
        model.backbone, heads, x2, ar[None], kv2, (ar[None, :] <= ar[:, None])[None], root2
    )
    np.testing.assert_allclose(np.array(seq2[:, 0, :5]), np.array(seq[:, 0, :5]), atol=1e-5)
    for t in (0, 3, 5):
        cache = make_prompt_cache(model.backbone)
        model.backbone(ids[None, : t + 1], cache=cache)
        got = model.stream_logits(x[0, t], int(ids[t + 1]), cache)  # (K, V)
        np.testing.assert_allclose(np.array(got), np.array(logits_seq[:, 0, t]), atol=1e-4)
        assert cache[0].offset == t + 1  # read only
    assert not np.allclose(np.array(logits_seq[0, 0, 5]), np.array(logits_seq[1, 0, 5]))  # streams differ


def test_msa_heads_roundtrip_and_config(tiny, tmp_path):
    model, tok = tiny
    heads = new_heads(
        model.backbone, tok, 2, scale=0.1, seed=2, architecture="msa", stream_layers=2, adapter_size=4
    )
    save_heads(heads, tmp_path / "h")
    loaded = load_heads(tmp_path / "h")
    assert loaded.attends and loaded.config.stream_layers == 2 and loaded.config.adapter_size == 4
    assert np.array_equal(np.array(loaded.streams), np.array(heads.streams))
    with pytest.raises(ValueError, match="stream_layers"):
        new_heads(model.backbone, tok, 2, architecture="msa", stream_layers=len(model.backbone.layers) + 1)
    with pytest.raises(ValueError, match="stream_logits"):
        model.heads = loaded
        model.head_logits(mx.zeros((model.args.hidden_size,)))


def test_trainable_stream_layers_start_as_the_backbones_and_round_trip(tiny, tmp_path):
    """Fresh trainable stream layers are copies of the backbone's top N_s layers: the
    streams equal those of frozen layers with (identity) adapters; they are the heads'
    own parameters (the backbone's stay out of them) and survive a save and load."""
    from mlx.utils import tree_flatten

    from mlx_stream.models import llama as fam

    model, tok = tiny
    ns = 2
    copies = new_heads(
        model.backbone, tok, 3, seed=3, architecture="msa", stream_layers=ns, stream_copies=True
    )
    frozen = new_heads(model.backbone, tok, 3, seed=3, architecture="msa", stream_layers=ns)
    for h in (copies, frozen):  # non-zero stream embeddings and root projection, the same in both
        h.streams = 0.3 * mx.random.normal(h.streams.shape, key=mx.random.key(5))
        h.root.weight = 0.1 * mx.random.normal(h.root.weight.shape, key=mx.random.key(6))
    ids = mx.array([5, 17, 33, 8, 91, 40, 2, 77])
    T = ids.shape[0]
    x, kv = _mid_and_kv(model, ids, ns)
    ar = mx.arange(T)
    root = mx.concatenate([ids[1:], mx.array([0])])[None]
    vis = (ar[None, :] <= ar[:, None])[None]
    a = fam.stream_hidden(model.backbone, copies, x, ar[None], kv, vis, root)
    b = fam.stream_hidden(model.backbone, frozen, x, ar[None], kv, vis, root)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    names = [k for k, _ in tree_flatten(copies.trainable_parameters())]
    assert any(k.startswith("layers.1.mlp") for k in names) and not any("adapters" in k for k in names)
    copies.layers[0].mlp.down_proj.weight = copies.layers[0].mlp.down_proj.weight * 1.5
    save_heads(copies, tmp_path / "h")
    loaded = load_heads(tmp_path / "h")
    assert loaded.config.stream_copies and loaded.config.layer_spec
    c = fam.stream_hidden(model.backbone, loaded, x, ar[None], kv, vis, root)
    d = fam.stream_hidden(model.backbone, copies, x, ar[None], kv, vis, root)
    np.testing.assert_allclose(np.array(c), np.array(d), atol=1e-6)
    assert not np.allclose(np.array(c), np.array(a), atol=1e-3)  # the changed copy is used
    with pytest.raises(ValueError, match="stream_copies"):
        HeadConfig(num_heads=2, hidden_size=8, vocab_size=10, architecture="hydra", stream_copies=True)


def test_the_api_speculates_by_default():
    # as the command line: the heads shipped for the model are attached unless asked otherwise
    from mlx_stream import load

    model, tok = load("smollm2-135m-instruct", dtype="float32")
    assert model.heads is not None and model.heads.config.tree
    plain, _ = load("smollm2-135m-instruct", heads=None, dtype="float32")
    assert plain.heads is None


def test_a_copy_of_a_model_that_ships_heads_gets_them(tiny, tmp_path):
    """Issue 48: the default model under another name (its converted folder, here linked
    into a new one) loads with the shipped heads, as the alias does: the fingerprint (same
    weights, same tokenizer) matches; a model of other weights gets none."""
    from mlx_stream.loader import default_heads_path, resolve_model_path, shipped_heads_for

    src = resolve_model_path("smollm2-135m-instruct")
    copy = tmp_path / "my-smollm2"
    copy.mkdir()
    for f in src.iterdir():
        (copy / f.name).symlink_to(f)
    model, tok = load(str(copy))
    shipped = default_heads_path("smollm2-135m-instruct")
    assert model.heads is not None and shipped_heads_for(model.backbone, tok) == shipped
    assert model.datastore is not None  # the datastore shipped beside the heads too
    assert load(str(copy), heads="none")[0].heads is None
    assert tiny[0].heads is None and shipped_heads_for(tiny[0].backbone, tiny[1]) is None
