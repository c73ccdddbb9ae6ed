"""Shared fixtures: a tiny random llama model (with a real BPE tokenizer trained on the
fly) for unit tests, and the real default model in float32 for the lossless tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest

# the command line drafts from (and adds to) this machine's store of the model's answers by
# default: tests (and the commands they start) decode without it unless they turn it on
os.environ["MLX_STREAM_LEARN"] = "0"

TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and "
    "verifies them in one pass. 0123456789 naïve café — streams, heads, trees!\n"
) * 20


def make_tiny_model_dir(
    path: Path,
    seed: int = 0,
    vocab: int = 384,
    context: int = 512,
    embed_scale: float = 1.0,
    hidden: int = 64,
    heads: int = 4,
) -> Path:
    """Write an mlx-lm llama folder with random weights and a byte-level BPE tokenizer.

    ``embed_scale`` is the embeddings' standard deviation: 1.0 gives near-deterministic
    next-token distributions, ~0.05 spreads them over a handful of tokens."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    n_vocab = tok.get_vocab_size()
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "bos_token": None,
                "clean_up_tokenization_spaces": False,
                "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                "<|endoftext|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}",
            }
        )
    )
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": n_vocab,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    # larger-than-default embeddings so the random model has peaked, varied predictions
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * embed_scale
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def spread_dir(tmp_path_factory) -> Path:
    """A tiny model whose next-token distributions put ~0.5 on the top token and spread
    the rest (random heads accept little; sampling has many outcomes)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("spread") / "model", embed_scale=0.26)


@pytest.fixture()
def tiny(tiny_dir):
    from mlx_stream import load

    return load(str(tiny_dir), dtype="float32")


@pytest.fixture(scope="session")
def real():
    """The default model, float32 (the converted GGUF, dequantised exactly)."""
    from mlx_stream import load

    try:
        return load("smollm2-135m-instruct", heads=None, dtype="float32")
    except FileNotFoundError as e:
        pytest.fail(f"the default model is part of the test setup (make test): {e}")
