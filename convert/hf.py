"""Hugging Face checkpoints (Llama 2, OPT) -> mlx-lm model folder.

A Hugging Face checkpoint folder holds ``config.json``, the weights as
``*.safetensors`` or ``pytorch_model*.bin`` (sharded with an ``*.index.json`` or
not; float32, float16 or bfloat16) and the tokenizer files. The output folder has
``config.json``, ``model.safetensors`` (mlx-lm's layout, optionally quantised with
mlx-lm's own ``quantize_model``) and the tokenizer files copied as they are, so
mlx-lm's ``TokenizerWrapper`` reads them (Llama 2's SentencePiece ``tokenizer.model``,
OPT's GPT-2 BPE ``vocab.json`` + ``merges.txt``).

* Llama 2 (``LlamaForCausalLM``): mlx-lm's ``llama`` model, whose weight names are
  Hugging Face's.
* OPT (``OPTForCausalLM``): :mod:`mlx_stream.models.opt` (mlx-lm has no OPT).

Every weight is checked against the model's parameters (names and shapes) before
anything is written; the folder is assembled beside ``out`` and renamed into place,
so a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_stream.files import staged_folder

TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "OPTForCausalLM": "opt"}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e


def model_classes(config: dict):
    """``(Model, ModelArgs)`` for a Hugging Face ``config.json`` of a supported family.

    Raises:
        ValueError: another architecture (the message lists the supported ones).
    """
    arch = (config.get("architectures") or [None])[0]
    kind = ARCHITECTURES.get(arch) or (
        config.get("model_type") if config.get("model_type") in ("llama", "opt") else None
    )
    if kind == "llama":
        from mlx_lm.models import llama

        return llama.Model, llama.ModelArgs
    if kind == "opt":
        from mlx_stream.models import opt

        return opt.Model, opt.ModelArgs
    raise ValueError(
        f"architecture {arch or config.get('model_type')!r} is not supported: "
        f"convert one of {', '.join(ARCHITECTURES)}"
    )


def weight_files(src: Path) -> list[Path]:
    """The checkpoint's weight files, safetensors preferred, in shard order.

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing.
    """
    for index, pattern in (
        ("model.safetensors.index.json", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        if (src / index).is_file():
            shards = sorted(set(_read_json(src / index).get("weight_map", {}).values()))
            missing = [s for s in shards if not (src / s).is_file()]
            if missing:
                raise FileNotFoundError(f"{src / index} names shards that are missing: {', '.join(missing)}")
            return [src / s for s in shards]
        files = sorted(src.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(f"{src}: no weights (*.safetensors or pytorch_model*.bin)")


def read_weights(files: list[Path]) -> dict[str, mx.array]:
    """All tensors of the given weight files.

    Raises:
        ValueError: a file that cannot be read (truncated, corrupt), naming it.
    """
    from .torch_bin import load_torch_bin

    weights: dict[str, mx.array] = {}
    for f in files:
        if f.suffix == ".bin":
            weights.update(load_torch_bin(f))
            continue
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from e
    return weights


def convert_hf(
    src: str | Path,
    out: str | Path,
    dtype: str | None = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
) -> Path:
    """Convert a Hugging Face Llama 2 or OPT checkpoint folder into an mlx-lm folder.

    Args:
        src: the checkpoint folder (``config.json``, weights, tokenizer files).
        out: the output folder (must not exist, or be empty).
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``; None keeps the
            checkpoint's (``torch_dtype`` in ``config.json``, else the tensors').
        quantize: quantise the linear and embedding layers (mlx-lm's affine
            quantisation) with ``q_bits`` in {4, 8} and ``q_group_size`` in {32, 64, 128}.

    Returns:
        ``out``.

    Raises:
        FileNotFoundError: ``src``, its ``config.json``, its weights or its tokenizer
            files are missing.
        ValueError: an unsupported architecture or option, a corrupt file, weights that
            do not match the configuration (the message names the tensor), a tokenizer
            that does not load, or a non-empty ``out``.
    """
    from mlx_lm.utils import load_tokenizer, quantize_model, save_config

    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: not a folder (a Hugging Face checkpoint folder is expected)")
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src / 'config.json'}: missing (a Hugging Face checkpoint has one)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: output folder exists and is not empty; choose another --out")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if quantize and (q_bits not in (4, 8) or q_group_size not in (32, 64, 128)):
        raise ValueError(
            f"quantisation needs --q-bits 4|8 and --q-group-size 32|64|128, got {q_bits}, {q_group_size}"
        )
    config = _read_json(src / "config.json")
    Model, ModelArgs = model_classes(config)
    toks = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not any(f in toks for f in ("tokenizer.model", "tokenizer.json", "vocab.json")):
        raise FileNotFoundError(
            f"{src}: no tokenizer (tokenizer.model, tokenizer.json or vocab.json + merges.txt)"
        )

    try:
        model = Model(ModelArgs.from_dict(config))
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{src / 'config.json'}: cannot build the model from it ({e})") from e
    weights = model.sanitize(read_weights(weight_files(src)))
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{src}: the weights do not match config.json: "
            + (f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unexpected {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}" if extra else "")
        )
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise ValueError(
                f"{src}: tensor {k} has shape {tuple(v.shape)}, config.json implies "
                f"{tuple(expected[k].shape)}"
            )
    target = DTYPES.get(dtype or config.get("torch_dtype") or config.get("dtype") or "")
    if target is not None:
        weights = {
            k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
        }
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    config = dict(config)
    if target is not None:
        config["torch_dtype"] = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}[
            target
        ]
    if quantize:
        model, config = quantize_model(model, config, q_group_size, q_bits)

    with staged_folder(out) as tmp:
        for f in toks:
            shutil.copyfile(src / f, tmp / f)
        try:
            load_tokenizer(tmp)
        except Exception as e:  # transformers raises many types; the message is what matters
            raise ValueError(f"{src}: the tokenizer files do not load ({type(e).__name__}: {e})") from e
        mx.save_safetensors(
            str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
        )
        save_config(config, tmp / "config.json")
    return out
