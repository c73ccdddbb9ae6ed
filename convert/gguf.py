"""GGUF (llama architecture) -> mlx-lm model folder.

MLX reads GGUF natively (``mx.load``): F32/F16 tensors as arrays, Q4_0/Q4_1/Q8_0
as MLX affine-quantised triplets (weight, scales, biases) with group size 32, which
represent the GGUF blocks exactly. What this module adds:

* tensor names mapped to the upstream (Hugging Face / mlx-lm) names;
* llama.cpp's permutation of the Q and K projection rows undone (llama.cpp's
  ``convert_hf_to_gguf.py`` interleaves the two rotary halves of every head, for its
  "traditional" RoPE; mlx-lm's llama uses the split-half layout);
* ``config.json`` from the GGUF metadata (with mlx-lm's ``quantization`` block when
  tensors stay quantised);
* ``tokenizer.json`` + ``tokenizer_config.json`` rebuilt from the GGUF's tokens,
  merges, special tokens and chat template (byte-level BPE vocabularies).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx

from mlx_stream.files import staged_folder

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp pre-tokenizer names -> (split digits individually, regex split before byte-level)
_PRE_TOKENIZERS = {
    "default": False,
    "gpt2": False,
    "gpt-2": False,
    "smollm": True,
    "starcoder": True,
    "refact": True,
}


def _scalar(meta, key, default=None):
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        return v.item()
    return v


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    """Inverse of llama.cpp's ``permute``: rows (n_head, D/2, 2) -> (n_head, 2, D/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGML_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
}
SUPPORTED_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")  # what mx.load reads exactly
_KV_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_tensor_types(path: str | Path) -> dict[str, str]:
    """``{tensor name: GGML type name}`` from a GGUF file's header (versions 2 and 3).

    Raises:
        ValueError: not a GGUF file, or a truncated or malformed header.
    """
    import struct

    path = Path(path)
    with open(path, "rb") as f:

        def read(n):
            b = f.read(n)
            if len(b) != n:
                raise ValueError(f"{path}: truncated GGUF header")
            return b

        def u32():
            return struct.unpack("<I", read(4))[0]

        def u64():
            return struct.unpack("<Q", read(8))[0]

        def string():
            return read(u64()).decode("utf-8", errors="replace")

        def skip_value(t):
            if t == 8:
                read(u64())
            elif t == 9:
                inner, n = u32(), u64()
                for _ in range(n):
                    skip_value(inner)
            elif t in _KV_SIZES:
                read(_KV_SIZES[t])
            else:
                raise ValueError(f"{path}: malformed GGUF metadata (value type {t})")

        if read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = u32()
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = u64(), u64()
        for _ in range(n_kv):
            string()
            skip_value(u32())
        types = {}
        for _ in range(n_tensors):
            name = string()
            for _ in range(u32()):
                u64()
            t = u32()
            u64()
            types[name] = GGML_TYPES.get(t, f"type {t}")
        return types


def read_gguf(path: str | Path) -> tuple[dict, dict]:
    """Read a GGUF file with MLX.

    Returns:
        ``(tensors, metadata)``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a readable GGUF or holds tensor types MLX does
            not load (anything but F32, F16, Q4_0, Q4_1, Q8_0); the message names it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: GGUF file not found")
    # MLX converts some other types to float16 without complaint, not always correctly
    # (Q4_K, for one, comes out wrong), so the header is checked first
    bad = {n: t for n, t in gguf_tensor_types(path).items() if t not in SUPPORTED_TYPES}
    if bad:
        name, kind = next(iter(bad.items()))
        kinds = sorted(set(bad.values()))
        raise ValueError(
            f"{path}: tensor {name} has type {kind} ({len(bad)} tensors of type {', '.join(kinds)}); "
            f"supported tensor types are {', '.join(SUPPORTED_TYPES)}: requantise the model to Q8_0 or Q4_0 "
            "with llama.cpp (llama-quantize --allow-requantize), or convert its Hugging Face checkpoint"
        )
    try:
        return mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(
            f"{path}: cannot read this GGUF ({e}); supported tensor types are F32, F16, Q4_0, Q4_1 and Q8_0"
        ) from e


def gguf_config(meta: dict, quantization: dict | None, tied: bool) -> dict:
    """An mlx-lm / Hugging Face ``config.json`` for a llama-architecture GGUF."""
    arch = meta.get("general.architecture")
    p = f"{arch}."
    n_head = int(_scalar(meta, p + "attention.head_count"))
    hidden = int(_scalar(meta, p + "embedding_length"))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, p + "block_count")),
        "intermediate_size": int(_scalar(meta, p + "feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_scalar(meta, p + "attention.head_count_kv", n_head)),
        "rms_norm_eps": float(_scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(_scalar(meta, p + "context_length", 2048)),
        "rope_theta": float(_scalar(meta, p + "rope.freq_base", 10000.0)),
        "head_dim": int(_scalar(meta, p + "rope.dimension_count", hidden // n_head)),
        "tie_word_embeddings": tied,
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
    }
    scaling = meta.get(p + "rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": float(_scalar(meta, p + "rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"rope scaling {scaling!r} in the GGUF is not supported (only linear)")
    if "tokenizer.ggml.vocab_size" in meta or p + "vocab_size" in meta:
        cfg["vocab_size"] = int(_scalar(meta, p + "vocab_size"))
    else:
        cfg["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    if quantization:
        cfg["quantization"] = quantization
        cfg["quantization_config"] = quantization
    return cfg


def gguf_weights(tensors: dict, meta: dict) -> dict:
    """GGUF tensors renamed to mlx-lm's llama names, Q/K rows un-permuted."""
    arch = meta.get("general.architecture")
    n_head = int(_scalar(meta, f"{arch}.attention.head_count"))
    n_kv = int(_scalar(meta, f"{arch}.attention.head_count_kv", n_head))
    out = {}
    for name, w in tensors.items():
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases|bias)", name)
        if m:
            layer, kind, suffix = m.groups()
            if kind not in _LAYER_MAP:
                raise ValueError(f"unexpected GGUF tensor {name!r} for a llama model")
            if kind == "attn_q":
                w = _unpermute(w, n_head)
            elif kind == "attn_k":
                w = _unpermute(w, n_kv)
            out[f"model.layers.{layer}.{_LAYER_MAP[kind]}.{suffix}"] = w
            continue
        m = re.fullmatch(r"(\w+)\.(weight|scales|biases)", name)
        if m and m.group(1) in _TOP_MAP:
            out[f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"] = w
        elif name != "rope_freqs.weight":
            raise ValueError(f"unexpected GGUF tensor {name!r} for a llama model")
    return out


def gguf_tokenizer(meta: dict, out_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` rebuilt from GGUF metadata.

    Raises:
        ValueError: a tokenizer model other than byte-level BPE (``gpt2``) or an
            unknown pre-tokenizer; the message names it.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "convert the Hugging Face checkpoint instead"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = meta.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types.tolist()] if types is not None else [1] * len(tokens)

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # GGUF token types: 3 = control, 4 = user-defined; both are matched whole
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    )
    tok.save(str(out_dir / "tokenizer.json"))

    def name(key):
        i = _scalar(meta, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, f"{meta.get('general.architecture')}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        tcfg["chat_template"] = meta["tokenizer.chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False))


def convert_gguf(src: str | Path, out: str | Path, dequantize: bool = False) -> Path:
    """Convert a llama-architecture GGUF file into an mlx-lm model folder.

    The folder (``config.json``, ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json``) loads with plain ``mlx_lm.load``. It is written to a
    temporary folder beside ``out`` and renamed into place, so a failed conversion
    leaves nothing behind.

    Args:
        src: the ``.gguf`` file.
        out: the output folder (must not exist, or be empty).
        dequantize: store float32 weights instead of keeping Q4_0/Q4_1/Q8_0 tensors
            MLX-quantised (both are exact representations of the GGUF).

    Raises:
        FileNotFoundError: ``src`` is missing.
        ValueError: not a llama-architecture GGUF, an unsupported tensor or
            tokenizer type, or ``out`` is a non-empty folder.
    """
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: output folder exists and is not empty; choose another --out")
    tensors, meta = read_gguf(src)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{src}: GGUF architecture {arch!r} is not supported (only 'llama')")
    weights = gguf_weights(tensors, meta)
    tied = "lm_head.weight" not in weights
    quantization = None
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    if quantized and dequantize:
        for base in quantized:
            w = weights.pop(base + ".weight")
            s = weights.pop(base + ".scales").astype(mx.float32)
            b = weights.pop(base + ".biases").astype(mx.float32)
            # uint32 columns per 32-weight group = bits per weight
            weights[base + ".weight"] = mx.dequantize(w, s, b, group_size=32, bits=w.shape[-1] // s.shape[-1])
    elif quantized:
        # every GGUF block type MLX loads has 32 weights per block
        # uint32 columns per 32-weight group = bits per weight; GGUF files mix widths
        # (e.g. Q8_0 embeddings beside Q4_1 layers): mlx-lm takes per-layer overrides
        bits = {b: weights[b + ".weight"].shape[-1] // weights[b + ".scales"].shape[-1] for b in quantized}
        common = max(set(bits.values()), key=list(bits.values()).count)
        quantization = {"group_size": 32, "bits": common, "mode": "affine"}
        for b, nb in sorted(bits.items()):
            if nb != common:
                quantization[b] = {"group_size": 32, "bits": nb, "mode": "affine"}

    with staged_folder(out) as tmp:
        cfg = gguf_config(meta, quantization, tied)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        gguf_tokenizer(meta, tmp)
    return out
