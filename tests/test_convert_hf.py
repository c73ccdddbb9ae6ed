"""Hugging Face Llama 2 and OPT checkpoints: conversion checked against transformers (torch
CPU) on tiny random checkpoints built here, speculative decoding and head training on them."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import TEXT
from helpers import mlx_lm_greedy, ours

from mlx_stream import load
from mlx_stream.convert import convert_hf, load_torch_bin
from mlx_stream.heads import new_heads

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TRICKY = [
    "Hello world",
    "  leading spaces and trailing  ",
    "digits 1234567890 and 3.14159",
    "unicode: naïve café — 日本語 ✓",
    "new\nlines\n\n\ttabs",
    "The quick brown fox jumps over the lazy dog.",
]
EXE = str(Path(sys.executable).parent / "mlx-stream")


def _llama2_tokenizer(folder: Path) -> None:
    # a SentencePiece BPE model with byte fallback, as Llama 2's, plus its tokenizer_config.json
    import sentencepiece as spm

    corpus = folder / "corpus.txt"
    corpus.write_text(TEXT + "Hello world.  Leading spaces, 42 digits, naïve café ✓\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        character_coverage=1.0,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "legacy": False,
                "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}",
            }
        )
    )


def _gpt2_tokenizer(folder: Path) -> None:
    # OPT's tokenizer: GPT-2 byte-level BPE (vocab.json + merges.txt), </s> as BOS and EOS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT],
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.model.save(str(folder))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": "</s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "add_bos_token": True,
            }
        )
    )


def _save(model, folder: Path, fmt: str) -> None:
    """Weights as HF ships them: safetensors, one pytorch_model.bin, or two .bin shards + index."""
    if fmt == "safetensors":
        model.save_pretrained(folder)
        return
    model.config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if fmt == "bin":
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = sorted(state)
    shards = {
        "pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
        "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, folder / file)
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}})
    )


def build_checkpoint(folder: Path, arch: str, fmt: str = "safetensors", dtype=None):
    """A tiny random ``LlamaForCausalLM`` or ``OPTForCausalLM`` (``opt`` pre-LayerNorm, ``opt-350m``
    post-LayerNorm with project_in/out) saved as a Hugging Face folder; returns the torch model."""
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    if arch == "llama":
        _llama2_tokenizer(folder)
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        cfg = transformers.LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        _gpt2_tokenizer(folder)
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        cfg = transformers.OPTConfig(
            vocab_size=len(tok),
            hidden_size=64,
            num_hidden_layers=2,
            ffn_dim=128,
            num_attention_heads=4,
            max_position_embeddings=256,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
            word_embed_proj_dim=32 if arch == "opt-350m" else 64,
            do_layer_norm_before=arch == "opt",
        )
        model = transformers.OPTForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the init's, so predictions are peaked and varied
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model = model.eval()
    if dtype is not None:
        model = model.to(dtype)
    _save(model, folder, fmt)
    return model


ARCHS = ["llama", "opt", "opt-350m"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """For each architecture: (HF folder, torch model, converted mlx folder)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for arch in ARCHS:
        src = root / arch
        ref = build_checkpoint(src, arch, fmt="safetensors" if arch == "llama" else "bin")
        out[arch] = (src, ref, convert_hf(src, root / f"{arch}-mlx"))
    return out


def _torch_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(converted, arch):
    src, ref, dst = converted[arch]
    model, tok = load(str(dst), dtype="float32")
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens")
    ours_ = np.array(model(mx.array(ids)[None])[0])
    diff = float(np.abs(ours_ - _torch_logits(ref, ids)).max())
    print(f"{arch}: max |logit diff| vs transformers over {len(ids)} positions: {diff:.2e}")
    assert diff < 1e-4
    # and the tree forward's states give the same logits as the plain forward
    from mlx_stream.cache import make_tree_cache

    cache = make_tree_cache(model.backbone)
    h, _ = model.family.tree_hidden(
        model.backbone,
        mx.array(ids),
        mx.arange(len(ids)),
        mx.array(np.tril(np.ones((len(ids), len(ids)), dtype=bool))),
        cache,
    )
    np.testing.assert_allclose(np.array(model.project(h)), ours_, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_agrees_with_transformers(converted, arch):
    src, _, dst = converted[arch]
    _, tok = load(str(dst), dtype="float32")
    hf = transformers.AutoTokenizer.from_pretrained(src)
    for text in TRICKY:
        ids = hf(text)["input_ids"]
        assert tok.encode(text) == ids, text
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
        # streamed text (mlx-lm's detokenizer, fed what generation emits: no BOS) is the decoded text
        body = [t for t in ids if t not in hf.all_special_ids]
        d = tok.detokenizer
        d.reset()
        for t in body:
            d.add_token(t)
        d.finalize()
        assert d.text == hf.decode(body), text
    assert tok.eos_token_ids == {2}


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_greedy_equals_plain(converted, arch):
    _, _, dst = converted[arch]
    model, tok = load(str(dst), dtype="float32")
    for p in ["The quick brown fox", "Speculative decoding drafts"]:
        ids = tok.encode(p)
        ref = mlx_lm_greedy(model, tok, ids, 40)
        assert ours(model, tok, ids, 40)[0] == ref  # plain through our loop
        model.heads = new_heads(model.backbone, tok, 3, scale=0.5, seed=1, architecture="hydra")
        for tree in ("chain:3", "sparse"):
            got, rs = ours(model, tok, ids, 40, tree=tree, adaptive=False)
            assert got == ref
        model.heads = None


def test_msa_heads_are_refused_for_opt(converted):
    _, _, dst = converted["opt"]
    model, tok = load(str(dst), dtype="float32")
    with pytest.raises(ValueError, match="llama-family"):
        new_heads(model.backbone, tok, 2, architecture="msa")


@pytest.mark.parametrize(
    "fmt,dtype", [("shards", torch.bfloat16), ("safetensors", torch.float16), ("bin", torch.float16)]
)
def test_formats_and_dtypes(tmp_path, fmt, dtype):
    ref = build_checkpoint(tmp_path / "src", "opt", fmt=fmt, dtype=dtype)
    dst = convert_hf(tmp_path / "src", tmp_path / "dst")
    cfg = json.loads((dst / "config.json").read_text())
    stored = mx.load(str(dst / "model.safetensors"))
    assert (
        stored["model.decoder.layers.0.fc1.weight"].dtype
        == {torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}[dtype]
    )
    assert cfg["model_type"] == "opt"
    # the weights are the checkpoint's exactly
    w = ref.state_dict()["model.decoder.layers.1.self_attn.q_proj.weight"].float().numpy()
    np.testing.assert_array_equal(
        np.array(stored["model.decoder.layers.1.self_attn.q_proj.weight"].astype(mx.float32)), w
    )
    out32 = convert_hf(tmp_path / "src", tmp_path / "dst32", dtype="float32")
    assert mx.load(str(out32 / "model.safetensors"))["model.decoder.layers.0.fc1.weight"].dtype == mx.float32


def test_torch_bin_reader_matches_torch(tmp_path):
    state = {
        "a": torch.randn(3, 4),
        "b": torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),  # a strided view
        "c": torch.randn(5).to(torch.bfloat16),
        "d": torch.tensor(2.5, dtype=torch.float16),
    }
    torch.save(state, tmp_path / "x.bin")
    got = load_torch_bin(tmp_path / "x.bin")
    for k, v in state.items():
        np.testing.assert_array_equal(np.array(got[k].astype(mx.float32)), v.float().numpy(), err_msg=k)
    assert got["c"].dtype == mx.bfloat16 and got["b"].dtype == mx.int64


def test_quantized_conversion(converted, tmp_path):
    src, ref, _ = converted["llama"]
    dst = convert_hf(src, tmp_path / "q8", quantize=True, q_bits=8, q_group_size=32)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 8 and cfg["quantization"]["group_size"] == 32
    model, tok = load(str(dst), dtype="quantized")
    ids = tok.encode("The quick brown fox jumps")
    got, want = np.array(model(mx.array(ids)[None])[0]), _torch_logits(ref, ids)
    # 8-bit weights: close, not exact (measured: max diff ~7% of the largest logit on these
    # deliberately large random weights, argmax equal at every position)
    assert np.abs(got - want).max() < 0.15 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8
    assert any(type(m).__name__ == "QuantizedLinear" for _, m in model.backbone.named_modules())


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_bad_checkpoints_are_refused_and_leave_nothing(tmp_path):
    src = tmp_path / "src"
    build_checkpoint(src, "opt", fmt="shards")
    out = tmp_path / "out"

    def refused(exc, match, path=src):
        with pytest.raises(exc, match=match):
            convert_hf(path, out)
        assert not out.exists() and _leftovers(tmp_path) == []  # no half-written folder

    # a truncated shard
    shard = src / "pytorch_model-00002-of-00002.bin"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])
    refused(ValueError, "pytorch_model-00002-of-00002.bin")
    # a missing shard
    shard.unlink()
    refused(FileNotFoundError, "missing: pytorch_model-00002-of-00002.bin")
    shard.write_bytes(good)
    # weights that do not match the configuration
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"ffn_dim": 96}))
    refused(ValueError, r"fc1\.(weight|bias) has shape .*config.json implies")
    (src / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    refused(ValueError, "missing model.decoder.layers.2")
    (src / "config.json").write_text(
        json.dumps(cfg | {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"})
    )
    refused(ValueError, "not supported")
    (src / "config.json").write_text("{not json")
    refused(ValueError, "config.json")
    (src / "config.json").write_text(json.dumps(cfg))
    # a corrupt safetensors file
    st = tmp_path / "st"
    build_checkpoint(st, "opt", fmt="safetensors")
    (st / "model.safetensors").write_bytes(b"\x00" * 64)
    refused(ValueError, "model.safetensors", st)
    # no tokenizer, no weights, no folder
    shutil.rmtree(st)
    build_checkpoint(st, "opt", fmt="safetensors")
    (st / "model.safetensors").rename(tmp_path / "weights")
    refused(FileNotFoundError, "no weights", st)
    (tmp_path / "weights").rename(st / "model.safetensors")
    for f in ("vocab.json", "merges.txt", "tokenizer.json"):
        (st / f).unlink(missing_ok=True)
    refused(FileNotFoundError, "no tokenizer", st)
    refused(FileNotFoundError, "not a folder", tmp_path / "nope")
    # a non-empty output folder is not touched
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        convert_hf(src, out)
    assert (out / "keep.txt").read_text() == "x"


@pytest.mark.parametrize("arch", ["llama", "opt-350m"])
def test_cli_convert_and_train_end_to_end(tmp_path, arch):
    src = tmp_path / "src"
    build_checkpoint(src, arch, fmt="bin")
    dst = tmp_path / "mlx"
    r = subprocess.run(
        [EXE, "convert", str(src), "--out", str(dst)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": p}) + "\n"
            for p in ["The quick brown fox", "heads, trees!", "0123 café", "drafts", "Speculative decoding"]
        )
    )
    out = tmp_path / "run"
    r = subprocess.run(
        [
            EXE,
            "train",
            "--model",
            str(dst),
            "--out",
            str(out),
            "--data",
            str(data),
            "--max-tokens",
            "24",
            "--epochs",
            "4",
            "--batch-size",
            "8",
            "--draft-vocab",
            "0",
            "--no-tune",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["final_loss"] < report["first_loss"]
    heads_cfg = json.loads((out / "heads" / "config.json").read_text())
    assert heads_cfg["fingerprint"]["architecture"] == ("llama" if arch == "llama" else "opt")
    g = subprocess.run(
        [
            EXE,
            "generate",
            "--model",
            str(dst),
            "--heads",
            str(out / "heads"),
            "-p",
            "The quick",
            "--max-tokens",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert g.returncode == 0, g.stderr
    assert json.loads(g.stdout)["heads"] is True
