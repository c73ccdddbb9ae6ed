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

import mlx.core as mx

from .cache import OwnCache, TreeKVCache, TreeQuantizedKVCache, WindowKVCache, make_tree_cache
from .checks import kind, require_int, require_path, require_tokenizer
from .generate import PromptCache
from .model import require_model
from .models import head_dim

TOKENS_KEY = "mlx_stream_tokens"  # (no dots: mlx-lm unflattens the metadata on them)
FINGERPRINT_KEY = "mlx_stream_fingerprint"
SOURCE_KEY = "mlx_stream_prompt"  # PromptCache.source: the system prompt and open user turn cached


_RECURRENT = (
    "this model keeps recurrent state in some layers: prompt cache files hold key/value caches "
    "only; keep the prompt cache in memory (PromptCache, ChatSession) instead"
)


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
    if any(isinstance(c, OwnCache) for c in cache.layers):
        raise ValueError(_RECURRENT)
    for c in cache.layers:
        n = c.offset
        if isinstance(c, WindowKVCache) and c.keep_first == 0:
            raise ValueError(
                "this model's sliding-window layers keep only their window: a prompt cache file holds "
                "whole caches, which it cannot be saved to yet"
            )
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
    } | ({SOURCE_KEY: json.dumps(cache.source)} if cache.source is not None else {})
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
    # the shapes this model's own caches take: one token through a fresh cache
    fresh = make_tree_cache(backbone)
    if any(isinstance(c, OwnCache) for c in fresh):
        raise ValueError(_RECURRENT)
    backbone(mx.array([[0]]), cache=fresh)
    if len(layers) != len(fresh):
        raise ValueError(
            f"{path}: made for another model ({meta.get('model', '?')}): {len(layers)} caches, "
            f"this model has {len(fresh)}"
        )
    converted = []
    for c, ref in zip(layers, fresh):
        if type(c) not in (KVCache, QuantizedKVCache):
            raise ValueError(
                f"{path}: holds a {type(c).__name__}; only full (optionally quantized) caches load"
            )
        quantized = isinstance(c, QuantizedKVCache)
        keys = c.keys[0] if quantized else c.keys
        dim = keys.shape[-1] * 32 // c.bits if quantized else keys.shape[-1]  # bits per uint32: 32
        kv_heads, head_dim = ref.keys.shape[1], ref.keys.shape[-1]
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
    cache.source = json.loads(meta[SOURCE_KEY]) if SOURCE_KEY in meta and TOKENS_KEY in meta else None
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
    check_kv(kv, head_dim(model.backbone))
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


def cached_prompt_text(tokenizer, system: str | None, prompt: str | None, raw: bool) -> str:
    """The text ``mlx-stream cache-prompt`` prefills: the system turn alone (a prefix of
    any conversation that starts with it), or with ``prompt`` the user turn left open for
    the next prompt to continue (as ``mlx_lm.cache_prompt``); ``raw`` (or a tokenizer
    without a chat template) joins the texts with a newline instead.

    Raises:
        ValueError: neither ``system`` nor ``prompt``.
    """
    if system is None and prompt is None:
        raise ValueError("give a system prompt, a prompt or both")
    if raw or tokenizer.chat_template is None:
        return "\n".join(x for x in (system, prompt) if x)
    msgs = [{"role": "system", "content": system}] if system else []
    if prompt is None:
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    msgs.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(msgs, tokenize=False, continue_final_message=True)


def _template(tokenizer, system: str | None, user: str) -> str:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def prompt_after_cache(
    tokenizer, cache: PromptCache | None, prompt: str, system: str | None = None, raw: bool = False
) -> tuple[list[int], str | None]:
    """The token ids to decode for a user ``prompt`` (``mlx-stream generate``'s), starting
    from a prompt-cache file's ``cache``, and the system prompt they carry.

    The prompt is built as without a cache (the chat template over ``system`` and the
    user turn, unless ``raw``) and must start with the cached tokens; a file made by
    ``mlx-stream cache-prompt`` supplies its own system prompt where ``system`` is None
    and its open user turn, which ``prompt`` continues. A file that holds no token ids
    (``mlx_lm.cache_prompt``'s) is continued as ``mlx_lm.generate`` does: the prompt's
    text from the user's content on follows the cached tokens.

    Returns:
        ``(ids, system)``: ids to pass to :func:`~mlx_stream.stream_generate` with
        ``prompt_cache=cache``, and the system prompt used (None: none).

    Raises:
        ValueError: the file cannot start this prompt: made with another system prompt,
            with(out) ``raw``, or its cached tokens are not the start of the prompt built;
            or ``system`` given with a file that holds no token ids (its own system
            prompt, if any, is in the cache). The message says what to pass instead.
    """
    from .generate import encode_prompt

    templated = not raw and tokenizer.chat_template is not None
    if cache is None:
        text = _template(tokenizer, system, prompt) if templated else prompt
        return encode_prompt(tokenizer, text), system
    known = [t for t in cache.tokens if t != -1]
    src = cache.source or {}
    if src:
        if src["raw"] == templated:
            raise ValueError(
                f"the prompt cache file was made {'with' if src['raw'] else 'without'} --raw: "
                f"{'pass' if src['raw'] else 'leave out'} --raw"
            )
        if system is not None and system != src["system"]:
            made = "another system prompt" if src["system"] else "no system prompt"
            raise ValueError(
                f"the prompt cache file was made with {made}: pass the same --system (or none, to use "
                "the file's), or make the file again with `mlx-stream cache-prompt --system ...`"
            )
        system = src["system"]
    if not known and system is not None:
        raise ValueError(
            "the prompt cache file holds no token ids (mlx_lm.cache_prompt's): the prompt continues "
            "it, so --system cannot apply; leave out --system or make the file with `mlx-stream cache-prompt`"
        )
    user = (src.get("prompt") or "") + prompt  # the open user turn, continued
    text = _template(tokenizer, system, user) if templated else "\n".join(x for x in (system, user) if x)
    if src.get("prompt") is not None and not templated:
        text = cached_prompt_text(tokenizer, system, src["prompt"], True) + prompt
    full = encode_prompt(tokenizer, text)
    if known and full[: len(known)] == known:
        return full, system
    if known and not (src.get("prompt") is not None or (not src and system is None)):
        raise ValueError(
            "the prompt cache file's tokens are not the start of this prompt (another system prompt "
            "or chat template?): make it again with `mlx-stream cache-prompt` for this prompt, or leave "
            "out --prompt-cache-file"
        )
    # as mlx_lm.generate: the prompt continues the cached one (an open user turn)
    if templated:
        test = _template(tokenizer, system, "<query>")
        text = text[test.index("<query>") + len(src.get("prompt") or "") :]
    else:
        text = prompt
    return known + tokenizer.encode(text, add_special_tokens=False), system


def chat_system_for_cache(tokenizer, cache: PromptCache, system: str | None = None) -> str | None:
    """The system prompt a chat (:class:`~mlx_stream.chat.ChatSession`) must start with
    for ``cache`` (a prompt-cache file's) to be its start: ``system``, or the file's own
    where ``system`` is None.

    Raises:
        ValueError: the file cannot start a conversation: it holds an open user turn
            (``cache-prompt --prompt``), no token ids (``mlx_lm.cache_prompt``'s), raw
            text, another system prompt than ``system``, or tokens that are not the start
            of the conversation's first turn. The message says what to do instead.
    """
    src = cache.source or {}
    if src.get("prompt") is not None or any(t == -1 for t in cache.tokens):
        made = "an open user turn (cache-prompt --prompt)" if src else "no token ids (mlx_lm.cache_prompt's)"
        raise ValueError(
            f"the prompt cache file holds {made}, which only `generate` continues; for a chat cache the "
            "system prompt alone: `mlx-stream cache-prompt --system ...`"
        )
    ids, system = prompt_after_cache(tokenizer, cache, "Hi", system)
    if ids[: len(cache.tokens)] != cache.tokens:
        raise ValueError(
            "the prompt cache file's tokens are not the start of this conversation (another system "
            "prompt?): make it again with `mlx-stream cache-prompt --system ...`, or leave it out"
        )
    return system
