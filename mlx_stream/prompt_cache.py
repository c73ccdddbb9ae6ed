"""Prompt cache files in mlx-lm's format (``mlx_lm.cache_prompt`` / ``--prompt-cache-file``).

A long system prompt or document is prefilled once and its KV cache saved; later
generations start from it and prefill only what follows. The file is mlx-lm's own
(``mlx_lm.models.cache.save_prompt_cache``: safetensors with the cache classes and
states), so files written here load in ``mlx_lm.generate --prompt-cache-file`` and files
written by ``mlx_lm.cache_prompt`` load here. Ours add three metadata entries: the
cached token ids (so a prompt that repeats them reuses them exactly), the backbone's
fingerprint (so a file made for another model is refused) and the mlx-stream version.
mlx-lm's files carry no token ids: as in ``mlx_lm.generate``, the prompt then continues
what the file holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .cache import TreeKVCache, TreeQuantizedKVCache, WindowKVCache
from .checks import kind, require_int, require_path, require_tokenizer
from .generate import PromptCache
from .model import require_model

TOKENS_KEY = "mlx_stream_tokens"  # (no dots: mlx-lm unflattens the metadata on them)
FINGERPRINT_KEY = "mlx_stream_fingerprint"


def save_prompt_cache(path: str | Path, cache: PromptCache, model_spec: str, tokenizer) -> Path:
    """Write ``cache`` to ``path`` (``.safetensors``) in mlx-lm's prompt-cache format,
    atomically (a temporary file renamed into place).

    Args:
        cache: a :class:`~mlx_stream.generate.PromptCache` after a prefill.
        model_spec: the model's name as given to :func:`mlx_stream.load` (mlx-lm's
            ``model`` metadata).
        tokenizer: the model's tokenizer (for the fingerprint).

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: the path does not end in ``.safetensors``; the cache is empty or
            bounded (``max_kv_size``: mlx-lm's rotating cache keeps other state).
    """
    from mlx_lm.models.cache import KVCache, QuantizedKVCache
    from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

    from .heads import backbone_fingerprint

    require_path(path)
    if not isinstance(cache, PromptCache):
        raise TypeError(
            f"cache must be a PromptCache (mlx_stream.cache_prompt or PromptCache(model)), got {kind(cache)}"
        )
    if not isinstance(model_spec, str):
        raise TypeError(
            f"model_spec must be a str (the model as given to mlx_stream.load), got {kind(model_spec)}"
        )
    require_tokenizer(tokenizer)
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: a prompt cache file name ends in .safetensors")
    if not cache.tokens:
        raise ValueError("the prompt cache is empty: prefill a prompt first")
    layers = []
    for c in cache.layers:
        n = c.offset
        if isinstance(c, WindowKVCache):
            raise ValueError("a bounded cache (max_kv_size) cannot be saved; save the prompt without it")
        if isinstance(c, TreeQuantizedKVCache):
            out = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
            out.keys = tuple(a[..., :n, :] for a in c.keys)
            out.values = tuple(a[..., :n, :] for a in c.values)
        else:
            out = KVCache()
            out.keys, out.values = c.keys[..., :n, :], c.values[..., :n, :]
        out.offset = n
        layers.append(out)
    meta = {
        "model": model_spec,
        "tokenizer_config": json.dumps({}),
        TOKENS_KEY: json.dumps(cache.tokens),
        FINGERPRINT_KEY: json.dumps(backbone_fingerprint(cache.backbone, tokenizer)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        mlx_lm_save(str(tmp), layers, meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_prompt_cache(path: str | Path, model, tokenizer) -> PromptCache:
    """A :class:`~mlx_stream.generate.PromptCache` from a prompt cache file (ours or
    ``mlx_lm.cache_prompt``'s).

    Returns:
        The cache; ``tokens`` holds the cached ids, or (mlx-lm's files, which store none)
        ``-1`` placeholders, and then :func:`mlx_stream.stream_generate` treats the
        prompt as continuing the cache.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        FileNotFoundError: no such file.
        ValueError: not a prompt cache file; made for another model (its fingerprint,
            number of layers or key/value shapes differ); a bounded (rotating) cache.
    """
    from mlx_lm.models.cache import KVCache, QuantizedKVCache
    from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load

    from .heads import backbone_fingerprint

    require_path(path)
    require_model(model)
    require_tokenizer(tokenizer)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompt cache file")
    try:
        layers, meta = mlx_lm_load(str(path), return_metadata=True)
    except Exception as e:  # safetensors/MLX errors for a file of another kind
        raise ValueError(f"{path}: not a prompt cache file ({type(e).__name__}: {e})") from e
    backbone = model.backbone
    if FINGERPRINT_KEY in meta and json.loads(meta[FINGERPRINT_KEY]) != backbone_fingerprint(
        backbone, tokenizer
    ):
        raise ValueError(
            f"{path}: made for another model ({meta.get('model', '?')}); make it again for this one"
        )
    if len(layers) != len(backbone.layers):
        raise ValueError(
            f"{path}: made for another model ({meta.get('model', '?')}): {len(layers)} layers, "
            f"this model has {len(backbone.layers)}"
        )
    args = backbone.args
    kv_heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    converted = []
    for c in layers:
        if type(c) not in (KVCache, QuantizedKVCache):
            raise ValueError(
                f"{path}: holds a {type(c).__name__}; only full (optionally quantized) caches load"
            )
        quantized = isinstance(c, QuantizedKVCache)
        keys = c.keys[0] if quantized else c.keys
        dim = keys.shape[-1] * 32 // c.bits if quantized else keys.shape[-1]  # bits per uint32: 32
        if keys is None or keys.shape[1] != kv_heads or dim != head_dim:
            raise ValueError(
                f"{path}: made for another model ({meta.get('model', '?')}): its keys do not have "
                f"{kv_heads} heads of {head_dim}"
            )
        out = TreeQuantizedKVCache(c.group_size, c.bits) if quantized else TreeKVCache()
        out.keys, out.values, out.offset = c.keys, c.values, c.offset
        converted.append(out)
    offsets = {c.offset for c in converted}
    if len(offsets) != 1:
        raise ValueError(f"{path}: its layers hold different numbers of tokens")
    cache = PromptCache(model)
    cache.layers[:] = converted
    n = offsets.pop()
    tokens = json.loads(meta[TOKENS_KEY]) if TOKENS_KEY in meta else [-1] * n
    if len(tokens) != n:
        raise ValueError(f"{path}: holds {n} tokens but lists {len(tokens)} token ids")
    cache.tokens = tokens
    return cache


def cache_prompt(
    model,
    tokenizer,
    prompt,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 5000,
    prefill_step_size: int = 2048,
) -> PromptCache:
    """Prefill ``prompt`` (text or token ids) into a new :class:`PromptCache`, as
    ``mlx_lm.cache_prompt`` does (chunks of ``prefill_step_size``, then the last token;
    quantized from ``quantized_kv_start`` with ``kv_bits``).

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: an empty or malformed prompt, a prompt longer than the context
            window, bad KV settings.
    """
    from .generate import encode_prompt
    from .steps import KVSettings, check_kv, prefill

    require_model(model)
    require_tokenizer(tokenizer)
    require_int(prefill_step_size, "prefill_step_size", 1)
    kv = KVSettings(None, kv_bits, kv_group_size, quantized_kv_start)
    args = model.backbone.args
    check_kv(kv, getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)
    ids = encode_prompt(tokenizer, prompt, model.args.vocab_size)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    ctx = model.context_length
    if ctx is not None and len(ids) >= ctx:
        raise ValueError(f"the prompt has {len(ids)} tokens but the model's context window is {ctx}")
    cache = PromptCache(model)
    # the full mlx-lm split (chunks, then the last token alone) whatever the settings
    prefill(
        model,
        cache,
        ids,
        None,
        prefill_step_size,
        KVSettings(None, kv_bits, kv_group_size, quantized_kv_start, True),
    )
    return cache
