"""Prompt cache files in mlx-lm's format: saved here, loaded by mlx-lm, and back."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from helpers import ours
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

from mlx_stream import cache_prompt, load, load_prompt_cache, save_prompt_cache
from mlx_stream.cache import TreeQuantizedKVCache

DOC = "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens. " * 3


def _mlx_lm_continue(model, tok, cache, suffix, n):
    out = []
    for r in mlx_lm.stream_generate(model, tok, mx.array(suffix), max_tokens=n, prompt_cache=cache):
        if r.finish_reason == "stop" and r.token in tok.eos_token_ids:
            break
        out.append(r.token)
    return out


def test_save_load_continue_equals_a_cold_start_and_mlx_lm(tiny, tmp_path):
    model, tok = tiny
    head, suffix = tok.encode(DOC), tok.encode(" And then", add_special_tokens=False)
    path = save_prompt_cache(tmp_path / "doc.safetensors", cache_prompt(model, tok, head), "tiny", tok)
    cold, _ = ours(model, tok, head + suffix, 24)
    cache = load_prompt_cache(path, model, tok)
    assert cache.tokens == head
    warm, rs = ours(model, tok, head + suffix, 24, prompt_cache=cache, tree="0;1", prompt_lookup=4)
    assert warm == cold and rs[-1].cached_tokens == len(head)
    # mlx-lm loads our file and continues it the same way
    theirs, meta = mlx_lm_load(str(path), return_metadata=True)
    assert meta["model"] == "tiny" and json.loads(meta["mlx_stream_tokens"]) == head
    assert _mlx_lm_continue(model, tok, theirs, suffix, 24) == cold
    # and a file mlx-lm wrote (no token ids) loads here: the prompt continues it
    c = make_prompt_cache(model)
    model(mx.array(head)[None], cache=c)
    mlx_lm_save(str(tmp_path / "theirs.safetensors"), c, {"model": "tiny", "tokenizer_config": "{}"})
    cache = load_prompt_cache(tmp_path / "theirs.safetensors", model, tok)
    assert cache.tokens == [-1] * len(head)
    got, rs = ours(model, tok, suffix, 24, prompt_cache=cache)
    assert got == cold and rs[-1].cached_tokens == len(head)


def test_quantized_caches_round_trip(tmp_path):
    from conftest import make_tiny_model_dir

    model, tok = load(str(make_tiny_model_dir(tmp_path / "wide", hidden=128, heads=2)), dtype="float32")
    head, suffix = tok.encode(DOC), tok.encode(" And then", add_special_tokens=False)
    kv = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0}
    path = save_prompt_cache(tmp_path / "q.safetensors", cache_prompt(model, tok, head, **kv), "wide", tok)
    cold, _ = ours(model, tok, head + suffix, 16, **kv)
    cache = load_prompt_cache(path, model, tok)
    assert isinstance(cache.layers[0], TreeQuantizedKVCache) and cache.layers[0].bits == 8
    warm, rs = ours(model, tok, head + suffix, 16, prompt_cache=cache, **kv)
    assert warm == cold and rs[-1].cached_tokens == len(head)


@pytest.mark.parametrize("bits", [3, 8])
def test_quantized_files_of_any_width_and_unknown_tokens(bits, tmp_path):
    from conftest import make_tiny_model_dir

    model, tok = load(str(make_tiny_model_dir(tmp_path / "wide", hidden=128, heads=2)), dtype="float32")
    head, suffix = tok.encode(DOC), tok.encode(" And then", add_special_tokens=False)
    kv = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 0}
    path = save_prompt_cache(tmp_path / "q.safetensors", cache_prompt(model, tok, head, **kv), "wide", tok)
    assert load_prompt_cache(path, model, tok).quantization == (bits, 64)
    # an mlx-lm file holds no token ids: quantized for other settings, it cannot be recomputed
    c = make_prompt_cache(model)
    for _ in generate_step(mx.array(head), model, max_tokens=0, prompt_cache=c, **kv):
        pass
    mlx_lm_save(str(tmp_path / "theirs.safetensors"), c, {"model": "wide"})
    with pytest.raises(ValueError, match="same kv_bits"):
        ours(
            model, tok, suffix, 4, prompt_cache=load_prompt_cache(tmp_path / "theirs.safetensors", model, tok)
        )
    got, _ = ours(
        model,
        tok,
        suffix,
        8,
        prompt_cache=load_prompt_cache(tmp_path / "theirs.safetensors", model, tok),
        **kv,
    )
    assert len(got) == 8


def test_files_for_another_model_or_broken_files_are_refused(tiny, spread_dir, tmp_path):
    from conftest import make_tiny_model_dir

    model, tok = tiny
    path = save_prompt_cache(tmp_path / "a.safetensors", cache_prompt(model, tok, DOC), "tiny", tok)
    other, otok = load(str(spread_dir), dtype="float32")  # same shapes, other weights
    with pytest.raises(ValueError, match="another model"):
        load_prompt_cache(path, other, otok)
    wide, wtok = load(str(make_tiny_model_dir(tmp_path / "wide", hidden=128, heads=2)), dtype="float32")
    c = make_prompt_cache(wide)  # an mlx-lm file (no fingerprint) with other shapes
    wide(mx.array(wtok.encode(DOC))[None], cache=c)
    mlx_lm_save(str(tmp_path / "w.safetensors"), c, {"model": "wide"})
    with pytest.raises(ValueError, match="another model"):
        load_prompt_cache(tmp_path / "w.safetensors", model, tok)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a prompt cache file"):
        load_prompt_cache(bad, model, tok)
    with pytest.raises(FileNotFoundError):
        load_prompt_cache(tmp_path / "missing.safetensors", model, tok)
    with pytest.raises(ValueError, match=".safetensors"):
        save_prompt_cache(tmp_path / "x.bin", cache_prompt(model, tok, DOC), "tiny", tok)


def test_cli_cache_prompt_then_generate(tiny_dir, tmp_path):
    f = str(tmp_path / "sys.safetensors")
    base = [sys.executable, "-m", "mlx_stream.cli"]
    model = ["--model", str(tiny_dir)]
    r = subprocess.run(
        [*base, "cache-prompt", "--system", DOC, "--out", f, *model], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    gen = [*base, "generate", "-p", "Hello", "--system", DOC, "--max-tokens", "12", "--json", *model]
    cold = json.loads(subprocess.run(gen, capture_output=True, text=True, check=True).stdout)
    # --system is cached, the prompt continues it: the same answer, the system turn reused
    warm = subprocess.run([*gen, "--prompt-cache-file", f], capture_output=True, text=True)
    assert warm.returncode == 0, warm.stderr
    warm = json.loads(warm.stdout)
    assert warm["text"] == cold["text"] and warm["prompt_tokens"] == cold["prompt_tokens"]
    r = subprocess.run(
        [*gen, "--prompt-cache-file", str(tmp_path / "nope.safetensors")], capture_output=True, text=True
    )
    assert r.returncode == 2 and "no such prompt cache file" in r.stderr


def test_a_prompt_cache_file_must_be_the_start_of_the_prompt_built(tiny_dir, tmp_path):
    """Issue 48: a file made with one --system is refused with another (it used to answer
    with the file's); without --system the file's own system prompt is used, with the user
    turn's header in place; chat checks the same; an open user turn is continued by generate
    only; raw and templated files are not mixed."""
    base = [sys.executable, "-m", "mlx_stream.cli"]
    model = ["--model", str(tiny_dir)]

    def cli(*args):
        return subprocess.run([*base, *args, *model], capture_output=True, text=True, timeout=600)

    sys_file, open_file = str(tmp_path / "sys.safetensors"), str(tmp_path / "open.safetensors")
    assert cli("cache-prompt", "--system", "You are a pirate.", "--out", sys_file).returncode == 0
    assert cli("cache-prompt", "--system", "Be brief.", "-p", DOC, "--out", open_file).returncode == 0
    gen = ["generate", "-p", "Hello", "--max-tokens", "8", "--json"]
    cold = json.loads(cli(*gen, "--system", "You are a pirate.").stdout)
    for extra in (["--system", "You are a pirate."], []):  # the same system prompt, or the file's own
        warm = cli(*gen, "--prompt-cache-file", sys_file, *extra)
        assert warm.returncode == 0, warm.stderr
        assert json.loads(warm.stdout)["tokens"] == cold["tokens"], extra
        assert json.loads(warm.stdout)["prompt_tokens"] == cold["prompt_tokens"]
    r = cli(*gen, "--prompt-cache-file", sys_file, "--system", "You are a robot.")
    assert r.returncode == 2 and "made with another system prompt" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # the open user turn: the prompt continues it, as one user turn DOC + prompt
    cold = json.loads(cli(*gen[:1], "-p", DOC + "Hello", *gen[3:], "--system", "Be brief.").stdout)
    warm = cli(*gen, "--prompt-cache-file", open_file)
    assert warm.returncode == 0 and json.loads(warm.stdout)["tokens"] == cold["tokens"], warm.stderr
    r = cli(*gen, "--prompt-cache-file", sys_file, "--raw")
    assert r.returncode == 2 and "made without --raw" in r.stderr, r.stderr
    chat = ["chat", "--max-tokens", "4", "--prompt-cache-file"]
    r = subprocess.run([*base, *chat, open_file, *model], input="hi\n", capture_output=True, text=True)
    assert r.returncode == 2 and "open user turn" in r.stderr, r.stderr
    r = subprocess.run(
        [*base, *chat, sys_file, "--system", "You are a robot.", *model],
        input="hi\n",
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "made with another system prompt" in r.stderr, r.stderr


def test_a_quantized_prompt_cache_file_needs_the_same_kv_bits(tiny_dir, tmp_path):
    """Issue 48: a file quantized with --kv-bits 8 used to be dropped silently (the whole
    prompt prefilled again) by a run without --kv-bits: refused in one line naming what to
    pass; with those options it is reused."""
    from conftest import make_tiny_model_dir

    base = [sys.executable, "-m", "mlx_stream.cli"]
    model = ["--model", str(tiny_dir)]

    def cli(*args):
        return subprocess.run([*base, *args, *model], capture_output=True, text=True, timeout=600)

    f = str(tmp_path / "q8.safetensors")
    r = cli("cache-prompt", "--system", DOC, "--kv-bits", "8", "--out", f)  # head dimension 16
    assert r.returncode == 2 and "cannot be quantized: leave out kv_bits" in r.stderr, r.stderr
    model = ["--model", str(make_tiny_model_dir(tmp_path / "wide", hidden=128, heads=2))]
    assert cli("cache-prompt", "--system", DOC, "--kv-bits", "8", "--out", f).returncode == 0
    gen = ["generate", "-p", "Hello", "--max-tokens", "4", "--json", "--no-heads", "--prompt-cache-file", f]
    r = cli(*gen)
    assert r.returncode == 2 and "pass --kv-bits 8 --kv-group-size 64" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli(*gen, "--kv-bits", "8")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cached_tokens"] > 0
