"""The frozen backbone, computed once: final hidden states and stream targets on disk.

For every position t whose next token belongs to a completion, the cache holds
the backbone's final (normed) hidden state h_t, shape ``(H,)``, and the tokens
``x[t+1], x[t+2], ..., x[t+1+K]``: column 0 is the backbone's own next token
(stream 0), column j is stream head j's target (Speculative Streaming,
Bhendawade et al. 2024, eq. 4), -1 past the end of the sequence. Both arrays are
memory-mapped ``.npy`` files, so training never runs the backbone again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .data import prompt_ids


@dataclass
class FeatureCache:
    """Memory-mapped features.

    Attributes:
        hidden: ``(P, H)`` float16 or float32 final hidden states.
        targets: ``(P, K + 1)`` int32 tokens t+1 .. t+1+K (-1 = none).
        meta: ``{"num_heads", "positions", "sequences", "dtype", "fingerprint"}``.
    """

    hidden: np.ndarray
    targets: np.ndarray
    meta: dict

    @property
    def num_heads(self) -> int:
        return self.targets.shape[1] - 1

    def __len__(self) -> int:
        return self.hidden.shape[0]


def sequence_ids(tokenizer, row: dict) -> tuple[list[int], int]:
    """``(ids, start)``: prompt (chat template) + completion + EOS, and the index of
    the first completion token."""
    p = prompt_ids(tokenizer, row["prompt"])
    c = tokenizer.encode(row["completion"], add_special_tokens=False)
    eos = tokenizer.eos_token_id
    return p + c + ([eos] if eos is not None else []), len(p)


def targets_for(ids: Sequence[int], start: int, num_heads: int) -> np.ndarray:
    """``(P, K + 1)`` targets for positions t = start-1 .. len(ids)-2: row t holds
    ``ids[t+1 .. t+1+K]``, -1 past the end."""
    ids = np.asarray(ids, dtype=np.int32)
    L = len(ids)
    t = np.arange(max(start - 1, 0), L - 1)
    cols = t[:, None] + 1 + np.arange(num_heads + 1)[None, :]
    out = np.full(cols.shape, -1, dtype=np.int32)
    ok = cols < L
    out[ok] = ids[cols[ok]]
    return out


def build_features(model, tokenizer, rows: Sequence[dict], out_dir: str | Path, num_heads: int,
                   dtype: str = "float16", fingerprint: dict | None = None, progress=None) -> FeatureCache:
    """Run the frozen backbone once over every ``{"prompt", "completion"}`` row (through
    the chat template, EOS appended) and write the feature cache; see
    :func:`build_features_from_ids`."""
    seqs = (sequence_ids(tokenizer, row) for row in rows)
    return build_features_from_ids(model, seqs, out_dir, num_heads, dtype, fingerprint, progress)


def build_features_from_ids(model, sequences, out_dir: str | Path, num_heads: int, dtype: str = "float16",
                            fingerprint: dict | None = None, progress=None) -> FeatureCache:
    """Run the frozen backbone once over ``(ids, start)`` sequences (positions from
    ``start - 1`` on are kept) and write the feature cache.

    Written into a temporary folder beside ``out_dir`` and renamed into place, so
    an interrupted build leaves nothing that looks complete.

    Raises:
        ValueError: an unknown ``dtype`` or no usable rows.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    if dtype not in ("float16", "float32"):
        raise ValueError(f"feature dtype must be float16 or float32, got {dtype!r}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        H = int(model.args.hidden_size)
        n_pos = n_seq = 0
        with open(tmp / "hidden.bin", "wb") as fh, open(tmp / "targets.bin", "wb") as ft:
            for i, (ids, start) in enumerate(sequences):
                if len(ids) - start < 1:
                    continue
                h = model.family.prefill_hidden(model.backbone, mx.array(ids), make_prompt_cache(model.backbone))
                first = max(start - 1, 0)
                h = np.array(h[first : len(ids) - 1].astype(getattr(mx, dtype)))
                tg = targets_for(ids, start, num_heads)
                assert h.shape == (tg.shape[0], H)
                fh.write(h.tobytes())
                ft.write(tg.tobytes())
                n_pos += tg.shape[0]
                n_seq += 1
                if progress:
                    progress(i + 1, n_pos)
        if n_pos == 0:
            raise ValueError("no training positions: every sequence has an empty completion")
        _bin_to_npy(tmp / "hidden.bin", tmp / "hidden.npy", np.dtype(dtype), (n_pos, H))
        _bin_to_npy(tmp / "targets.bin", tmp / "targets.npy", np.dtype(np.int32), (n_pos, num_heads + 1))
        meta = {"num_heads": num_heads, "positions": n_pos, "sequences": n_seq, "dtype": dtype,
                "fingerprint": fingerprint or {}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_features(out_dir)


def _bin_to_npy(src: Path, dst: Path, dtype: np.dtype, shape: tuple) -> None:
    raw = np.memmap(src, dtype=dtype, mode="r", shape=shape)
    out = np.lib.format.open_memmap(dst, mode="w+", dtype=dtype, shape=shape)
    for i in range(0, shape[0], 65536):
        out[i : i + 65536] = raw[i : i + 65536]
    out.flush()
    del raw, out
    src.unlink()


def load_features(path: str | Path) -> FeatureCache:
    """Open a feature cache (memory-mapped, read-only).

    Raises:
        FileNotFoundError: a missing file (named).
        ValueError: files that disagree with ``meta.json``.
    """
    path = Path(path)
    for name in ("meta.json", "hidden.npy", "targets.npy"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name}: feature cache file missing (rebuild the cache)")
    meta = json.loads((path / "meta.json").read_text())
    hidden = np.load(path / "hidden.npy", mmap_mode="r")
    targets = np.load(path / "targets.npy", mmap_mode="r")
    if hidden.shape[0] != meta["positions"] or targets.shape != (meta["positions"], meta["num_heads"] + 1):
        raise ValueError(f"{path}: feature files do not match meta.json (rebuild the cache)")
    return FeatureCache(hidden, targets, meta)
