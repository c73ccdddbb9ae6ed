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
    layers: int = 2,
    tied: bool = True,
    head_scale: float = 1.0,
) -> Path:
    """Write an mlx-lm llama folder with random weights and a byte-level BPE tokenizer.

    ``embed_scale`` is the embeddings' standard deviation: 1.0 gives near-deterministic
    next-token distributions, ~0.05 spreads them over a handful of tokens. Tied
    embeddings make the greedy text one token repeated (each token's own embedding
    scores highest after it); ``tied=False`` gives an output head of its own (standard
    deviation ``head_scale``: 1.0 peaked, ~0.15 spread), whose greedy text wanders over
    many tokens."""
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
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": n_vocab,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
        "eos_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    # larger-than-default embeddings so the random model has peaked, varied predictions
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * embed_scale
    if not tied:
        model.lm_head.weight = mx.random.normal(model.lm_head.weight.shape) * head_scale
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
    """The default model, float32 (the converted GGUF, dequantised exactly), loaded once per
    worker: tests that attach heads or a datastore to it take them off again."""
    from mlx_stream import load

    try:
        return load("smollm2-135m-instruct", heads=None, dtype="float32")
    except FileNotFoundError as e:
        pytest.fail(f"the default model is part of the test setup (make test): {e}")


@pytest.fixture(scope="session")
def shipped(real):
    """``(heads, datastore)`` shipped for the default model, as ``load(heads="default")``
    reads them (the heads checked against the backbone's fingerprint), once per worker."""
    from mlx_stream.datastore import STORE_FILE, load_store
    from mlx_stream.heads import backbone_fingerprint, load_heads
    from mlx_stream.loader import default_heads_path

    model, tok = real
    path = default_heads_path("smollm2-135m-instruct")
    assert path is not None, "the package ships heads for the default model"
    fp = backbone_fingerprint(model.backbone, tok)
    return load_heads(path, fp), load_store(path / STORE_FILE, fp["tokenizer"])  # refuse another backbone


# Under pytest-xdist (make test / make test-all: `-n 2 --dist worksteal`) the slow tests
# run first, longest first: each worker starts on its share of the collection, an idle one
# takes the tail of the other's (the quick tests, then the shortest slow ones), so the two
# finish together instead of one running a chi-square test while the other waits. Rough
# seconds on a 2-core CPU with both workers busy, used for the order only (a test not
# listed counts SLOW_DEFAULT_S); a wrong value costs time, never a check.
SLOW_S = {
    "test_sampling.py::test_sampled_tokens_follow_the_plain_distribution": 330,
    "test_sampling.py::test_sampled_tokens_follow_the_plain_distribution_with_queued_drafting_steps": 170,
    "test_kv.py::test_real_model_max_kv_size_equals_mlx_lm[256]": 260,
    "test_real_identity.py::test_greedy_identity_real": 120,
    "test_cli.py::test_answers_grow_with_generate_show_add_and_clear": 100,
    "test_cli.py::test_train_end_to_end_and_resume": 90,
    "test_cli.py::test_train_killed_at_any_point_resumes_to_the_same_heads": 80,
    "test_kv.py::test_real_model_max_kv_size_equals_mlx_lm[64]": 80,
    "test_draft_model.py::test_real_model_with_a_3_bit_copy_as_draft_is_lossless_greedy_and_seeded": 90,
    "test_draft_model.py::test_sampling_with_a_draft_model_follows_the_plain_distribution": 60,
    "test_eagle3.py::test_sampling_with_a_published_eagle3_follows_the_plain_distribution": 80,
    "test_dflash.py::test_sampling_with_a_published_dflash_follows_the_plain_distribution": 200,
    "test_distributed.py::test_train_under_mlx_launch_equals_one_rank_and_resumes_after_a_rank_is_killed": 50,
    "test_server.py::test_real_model_streamed_greedy_text_equals_generate": 60,
    "test_kv.py::test_real_model_kv_bits_equals_mlx_lm": 50,
    "test_real_identity.py::test_greedy_identity_real_with_processors": 50,
    "test_real_identity.py::test_replay_matches_the_loop": 50,
    "test_sampling.py::test_the_same_test_rejects_a_biased_verifier": 40,
    "test_distributed.py::test_bench_under_mlx_launch_splits_the_prompts": 30,
    "test_train.py::test_resume_after_kill_matches_uninterrupted": 2,
}
SLOW_DEFAULT_S = 60


def _expected_s(item) -> float:
    name = f"{item.path.name}::{item.name}"
    return SLOW_S.get(name, SLOW_S.get(name.split("[")[0], SLOW_DEFAULT_S))


@pytest.hookimpl(trylast=True)  # after -m/-k deselection
def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the files' order (module fixtures set up once)
    slow = [it for it in items if it.get_closest_marker("slow")]
    rest = [it for it in items if not it.get_closest_marker("slow")]
    slow.sort(key=_expected_s, reverse=True)  # stable: equal estimates keep the files' order
    items[:] = slow + rest  # the same order on every worker (xdist checks)
