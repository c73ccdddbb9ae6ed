"""GGUF -> mlx-lm conversion, checked against an independent implementation
(transformers' GGUF loader on torch CPU, which dequantises with the gguf package)."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlx_stream.convert import convert_gguf
from mlx_stream.convert.gguf import _unpermute
from mlx_stream.loader import _alias_gguf

TRICKY = [
    "Hello world",
    "  leading spaces and trailing  ",
    "digits 1234567890 and 3.14159, 1,000,000",
    "unicode: naïve café — 日本語 emoji 🙂 Ünïcödé",
    "new\nlines\n\n\ttabs\r\n",
    "<|im_start|>user\nspecial tokens<|im_end|>",
    "code: def f(x):\n    return x**2  # comment",
]


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, re-stated for the test
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    for n_head in (1, 2, 3):
        back = np.array(_unpermute(mx.array(_llama_cpp_permute(w, n_head)), n_head))
        np.testing.assert_array_equal(back, w)


@pytest.fixture(scope="module")
def gguf_path():
    return _alias_gguf("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def reference(gguf_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, torch_dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return torch, model.eval(), tok


def test_logits_match_transformers_gguf(real, reference):
    torch, ref_model, _ = reference
    model, tok = real
    text = (
        "The capital of France is Paris, and the capital of Germany is Berlin. "
        "In 1969, Apollo 11 landed on the Moon; def add(a, b): return a + b"
    )
    ids = tok.encode(text)
    assert len(ids) >= 24
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].numpy()
    got = np.array(model(mx.array([ids]))[0])
    diff = float(np.abs(ref - got).max())
    # measured 1.1e-4 (exact float32 dequantisation on both sides); without the Q/K
    # un-permutation the difference is O(10) and the text is garbage
    assert diff < 1e-2, diff
    assert (ref.argmax(-1) == got.argmax(-1)).all()


@pytest.mark.parametrize("text", TRICKY)
def test_tokenizer_matches_transformers_gguf(real, reference, text):
    _, _, ref_tok = reference
    _, tok = real
    ids = tok.encode(text)
    assert ids == ref_tok.encode(text)
    assert tok.decode(ids) == ref_tok.decode(ids)


def test_chat_template_and_eos_carried_over(real):
    _, tok = real
    assert tok.eos_token_ids == {2} and tok.eos_token == "<|im_end|>"
    p = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert p.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_convert_output_loads_in_plain_mlx_lm(gguf_path, tmp_path):
    import mlx_lm

    out = convert_gguf(gguf_path, tmp_path / "q")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.embed_tokens"]["bits"] == 8
    model, tok = mlx_lm.load(str(out))
    text = mlx_lm.generate(
        model,
        tok,
        tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
            tokenize=False,
        ),
        max_tokens=12,
    )
    assert "Paris" in text


def test_refuses_other_architectures_and_leaves_nothing(tmp_path):
    bad = tmp_path / "gpt2.gguf"
    mx.save_gguf(str(bad), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "gpt2"})
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        convert_gguf(bad, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.gguf"]


def test_refuses_missing_corrupt_and_nonempty(tmp_path, gguf_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        convert_gguf(junk, tmp_path / "out")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        convert_gguf(gguf_path, full)
    assert (full / "x").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "junk.gguf"]


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "BF16"])
def test_refuses_tensor_types_mlx_does_not_read_exactly(tmp_path, kind):
    # MLX turns Q4_K into float16 without complaint, but wrongly; every type outside
    # F32/F16/Q4_0/Q4_1/Q8_0 is refused by name before anything is read
    gguf = pytest.importorskip("gguf")
    qt = getattr(gguf.GGMLQuantizationType, kind)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    path = tmp_path / f"{kind}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 256), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 256 // block * size), dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=f"blk.0.attn_q.weight has type {kind}.*Q4_0, Q4_1, Q8_0"):
        convert_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_header_types_agree_with_the_gguf_package(gguf_path):
    gguf = pytest.importorskip("gguf")
    from mlx_stream.convert.gguf import gguf_tensor_types

    ref = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(gguf_path)).tensors}
    assert gguf_tensor_types(gguf_path) == ref


def test_conversion_cache_is_keyed_by_content(gguf_path, tmp_path, monkeypatch):
    import os
    import shutil

    import mlx_stream.convert
    from mlx_stream.loader import resolve_model_path

    monkeypatch.setenv("MLX_STREAM_CACHE", str(tmp_path / "cache"))
    real_convert, calls = mlx_stream.convert.convert_gguf, []

    def counting_convert(*args, **kwargs):
        calls.append(args)
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(mlx_stream.convert, "convert_gguf", counting_convert)
    a, b = tmp_path / "clone1" / "model.gguf", tmp_path / "clone2" / "model.gguf"
    for p, t in ((a, 1_600_000_000), (b, 1_700_000_000)):
        p.parent.mkdir()
        shutil.copyfile(gguf_path, p)
        os.utime(p, (t, t))
    out = resolve_model_path(a)
    assert resolve_model_path(b) == out and resolve_model_path(a) == out
    assert len(calls) == 1 and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    # everything under models/ is the one complete folder: no staging leftovers
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [out.name]
    # the same content under another file name reuses it too
    c = tmp_path / "clone3" / "renamed.gguf"
    c.parent.mkdir()
    shutil.copyfile(a, c)
    assert resolve_model_path(c) == out and len(calls) == 1
    index = json.loads((tmp_path / "cache" / "gguf-sha256.json").read_text())
    assert {str(p.resolve()) for p in (a, b, c)} <= set(index)
    (digest,) = {e["sha256"] for e in index.values()}
    assert out.name == f"model-{digest[:12]}"


def test_conversion_cache_survives_another_process_finishing_first(tmp_path, monkeypatch):
    import mlx_stream.convert
    from mlx_stream.files import staged_folder
    from mlx_stream.loader import resolve_model_path

    monkeypatch.setenv("MLX_STREAM_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"not really a gguf")
    models = tmp_path / "cache" / "models"

    def racing_convert(gguf, out):  # convert_gguf's own staging, with a rival in the middle
        with staged_folder(out) as tmp:
            (tmp / "config.json").write_text('{"ours": true}')
            out.mkdir(parents=True)  # meanwhile another process renames its complete copy in
            (out / "config.json").write_text('{"theirs": true}')
        return out

    monkeypatch.setattr(mlx_stream.convert, "convert_gguf", racing_convert)
    out = resolve_model_path(src)
    assert json.loads((out / "config.json").read_text()) in ({"ours": True}, {"theirs": True})
    assert [p.name for p in models.iterdir()] == [out.name]  # no half-made or stale folder left

    def late_convert(gguf, out):  # the rival's copy is complete before this one starts writing
        out.mkdir(parents=True)
        (out / "config.json").write_text('{"theirs": true}')
        with staged_folder(out) as tmp:  # refuses a non-empty folder (ValueError)
            (tmp / "config.json").write_text('{"ours": true}')

    shutil.rmtree(models)
    monkeypatch.setattr(mlx_stream.convert, "convert_gguf", late_convert)
    out = resolve_model_path(src)
    assert json.loads((out / "config.json").read_text()) == {"theirs": True}
    assert [p.name for p in models.iterdir()] == [out.name]
