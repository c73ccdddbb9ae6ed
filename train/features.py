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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .data import prompt_ids


@dataclass
class FeatureCache:
    """Memory-mapped features.

    Attributes:
        hidden: ``(P, H)`` float16 or float32 final hidden states.
        targets: ``(P, K + 1)`` int32 tokens t+1 .. t+1+K (-1 = none).
        meta: ``{"num_heads", "positions", "sequences", "dtype", "fingerprint"}``.
        path: the folder it was loaded from.
    """

    hidden: np.ndarray
    targets: np.ndarray
    meta: dict
    path: Path | None = None

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


def build_features(
    model,
    tokenizer,
    rows: Sequence[dict],
    out_dir: str | Path,
    num_heads: int,
    dtype: str = "float16",
    fingerprint: dict | None = None,
    progress=None,
) -> FeatureCache:
    """Run the frozen backbone once over every ``{"prompt", "completion"}`` row (through
    the chat template, EOS appended) and write the feature cache; see
    :func:`build_features_from_ids`."""
    seqs = (sequence_ids(tokenizer, row) for row in rows)
    return build_features_from_ids(model, seqs, out_dir, num_heads, dtype, fingerprint, progress)


class FeatureWriter:
    """A feature cache under construction, appended one sequence at a time and
    resumable. It lives in ``<out_dir>.partial/`` (raw ``hidden.bin``, ``targets.bin``,
    ``rows.jsonl`` with one JSON row per sequence, and ``lengths.bin``, the positions
    of each sequence, written last as its commit mark) until :meth:`finish` converts
    it to ``.npy`` files and renames it to ``out_dir``, so nothing half-built ever
    looks complete.

    Args:
        out_dir: the final cache folder.
        hidden_size: H.
        num_heads: K (targets have K + 1 columns).
        dtype: "float16" or "float32" for the hidden states.
        resume: keep the whole sequences already in ``<out_dir>.partial/`` (a sequence
            cut off by a kill is truncated away); otherwise start afresh.

    Attributes:
        rows: the rows of the sequences written so far, in order.

    Raises:
        ValueError: an unknown ``dtype``, or a partial folder built for another K or H.
    """

    def __init__(
        self,
        out_dir: str | Path,
        hidden_size: int,
        num_heads: int,
        dtype: str = "float16",
        resume: bool = False,
    ):
        if dtype not in ("float16", "float32"):
            raise ValueError(f"feature dtype must be float16 or float32, got {dtype!r}")
        self.out_dir = Path(out_dir)
        self.tmp = self.out_dir.with_name(self.out_dir.name + ".partial")
        self.H, self.K, self.dtype = hidden_size, num_heads, np.dtype(dtype)
        if not resume:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        shape = {"hidden_size": self.H, "num_heads": self.K, "dtype": self.dtype.name}
        spec = self.tmp / "shape.json"
        if spec.is_file() and json.loads(spec.read_text()) != shape:
            raise ValueError(f"{self.tmp}: built as {spec.read_text()}, not {shape}; delete it to rebuild")
        spec.write_text(json.dumps(shape))
        lp = self.tmp / "lengths.bin"
        raw = lp.read_bytes() if lp.is_file() else b""
        lengths = np.frombuffer(raw[: len(raw) // 8 * 8], dtype=np.int64)
        rp = self.tmp / "rows.jsonl"
        lines = rp.read_text(encoding="utf-8").splitlines(keepends=True) if rp.is_file() else []
        n = min(len(lengths), len(lines))
        self.rows = [json.loads(line) for line in lines[:n]]
        assert len(self.rows) == n, "a committed sequence without its row"
        self.sequences, self.positions = n, int(lengths[:n].sum())
        rows_bytes = sum(len(line.encode("utf-8")) for line in lines[:n])
        for name, nbytes in (
            ("lengths.bin", n * 8),
            ("rows.jsonl", rows_bytes),
            ("hidden.bin", self.positions * self.H * self.dtype.itemsize),
            ("targets.bin", self.positions * (self.K + 1) * 4),
        ):
            with open(self.tmp / name, "ab") as f:
                f.truncate(nbytes)
        self._files = {
            n: open(self.tmp / n, "ab") for n in ("hidden.bin", "targets.bin", "rows.jsonl", "lengths.bin")
        }

    def add(self, hidden: np.ndarray, targets: np.ndarray, row: dict | None = None) -> None:
        """Append one sequence: ``hidden`` ``(n, H)``, ``targets`` ``(n, K + 1)`` int32 and
        its dataset ``row``. Its length is written last: a sequence counts only once whole."""
        assert hidden.shape == (targets.shape[0], self.H) and targets.shape[1] == self.K + 1
        row = row or {}
        f = self._files
        f["hidden.bin"].write(np.ascontiguousarray(hidden, dtype=self.dtype).tobytes())
        f["targets.bin"].write(np.ascontiguousarray(targets, dtype=np.int32).tobytes())
        f["rows.jsonl"].write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        for name in ("hidden.bin", "targets.bin", "rows.jsonl"):
            f[name].flush()
        f["lengths.bin"].write(np.int64(len(targets)).tobytes())
        f["lengths.bin"].flush()
        self.rows.append(row)
        self.sequences += 1
        self.positions += len(targets)

    def extend(self, cache: FeatureCache) -> None:
        """Append a whole finished cache (its ``rows.jsonl`` too, when it kept one)."""
        assert cache.hidden.shape[1] == self.H and cache.num_heads >= self.K
        rp = cache.path / "rows.jsonl" if cache.path else None
        rows = (
            [json.loads(line) for line in rp.read_text(encoding="utf-8").splitlines()]
            if rp and rp.is_file()
            else []
        )
        f = self._files
        for i in range(0, len(cache), 65536):
            f["hidden.bin"].write(
                np.ascontiguousarray(cache.hidden[i : i + 65536], dtype=self.dtype).tobytes()
            )
            f["targets.bin"].write(np.ascontiguousarray(cache.targets[i : i + 65536, : self.K + 1]).tobytes())
        f["rows.jsonl"].write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
        for name in ("hidden.bin", "targets.bin", "rows.jsonl"):
            f[name].flush()
        f["lengths.bin"].write(np.int64(len(cache)).tobytes())
        f["lengths.bin"].flush()
        self.rows += rows
        self.sequences += int(cache.meta.get("sequences", 0))
        self.positions += len(cache)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def finish(self, fingerprint: dict | None = None, keep_rows: bool = False) -> FeatureCache:
        """Convert to ``.npy``, write ``meta.json`` and move into ``out_dir`` (with
        ``rows.jsonl`` when ``keep_rows``).

        Raises:
            ValueError: no positions were added.
        """
        self.close()
        if self.positions == 0:
            raise ValueError("no training positions: every sequence has an empty completion")
        _bin_to_npy(self.tmp / "hidden.bin", self.tmp / "hidden.npy", self.dtype, (self.positions, self.H))
        _bin_to_npy(
            self.tmp / "targets.bin",
            self.tmp / "targets.npy",
            np.dtype(np.int32),
            (self.positions, self.K + 1),
        )
        for name in ("lengths.bin", "shape.json") + (() if keep_rows else ("rows.jsonl",)):
            (self.tmp / name).unlink()
        meta = {
            "num_heads": self.K,
            "positions": self.positions,
            "sequences": self.sequences,
            "dtype": self.dtype.name,
            "fingerprint": fingerprint or {},
        }
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp, self.out_dir)
        return load_features(self.out_dir)


def build_features_from_ids(
    model,
    sequences,
    out_dir: str | Path,
    num_heads: int,
    dtype: str = "float16",
    fingerprint: dict | None = None,
    progress=None,
) -> FeatureCache:
    """Run the frozen backbone once over ``(ids, start)`` sequences (positions from
    ``start - 1`` on are kept) and write the feature cache (through a
    :class:`FeatureWriter`, so an interrupted build leaves nothing that looks complete).

    Raises:
        ValueError: an unknown ``dtype`` or no usable rows.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    H = model.state_size
    writer = FeatureWriter(out_dir, H, num_heads, dtype)
    try:
        for i, (ids, start) in enumerate(sequences):
            if len(ids) - start < 1:
                continue
            h, _ = model.family.prefill_hidden(
                model.backbone, mx.array(ids), make_prompt_cache(model.backbone)
            )
            h = np.array(h[max(start - 1, 0) : len(ids) - 1].astype(getattr(mx, dtype)))
            writer.add(h, targets_for(ids, start, num_heads))
            if progress:
                progress(i + 1, writer.positions)
        return writer.finish(fingerprint)
    finally:
        writer.close()
        shutil.rmtree(writer.tmp, ignore_errors=True)


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
    return FeatureCache(hidden, targets, meta, path)
