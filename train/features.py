"""The frozen backbone, computed once: final hidden states and stream targets on disk.

For every position t whose next token belongs to a completion, the cache holds
the backbone's final (normed) hidden state h_t, shape ``(H,)``, and the tokens
``x[t+1], x[t+2], ..., x[t+1+K]``: column 0 is the backbone's own next token
(stream 0), column j is stream head j's target (Speculative Streaming,
Bhendawade et al. 2024, eq. 4), -1 past the end of the sequence. Optionally it
also holds the backbone's top-k next-token log-probabilities at t (the soft
target of head j at t - j; EAGLE and Medusa-2 distil the target's distribution).
All arrays are memory-mapped ``.npy`` files, so training never runs the backbone
again.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
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
        meta: ``{"num_heads", "positions", "sequences", "dtype", "fingerprint", "top_k"}``.
        path: the folder it was loaded from.
        top_logprobs: ``(P, k)`` float16 log-probabilities of the backbone's k most
            likely next tokens at each position (descending), or None.
        top_ids: ``(P, k)`` int32 ids of those tokens, or None.
    """

    hidden: np.ndarray
    targets: np.ndarray
    meta: dict
    path: Path | None = None
    top_logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None

    @property
    def top_k(self) -> int:
        return 0 if self.top_ids is None else self.top_ids.shape[1]

    @property
    def num_heads(self) -> int:
        return self.targets.shape[1] - 1

    def __len__(self) -> int:
        return self.hidden.shape[0]


def sequence_ids(tokenizer, row: dict) -> tuple[list[int], int]:
    """``(ids, start)``: prompt (chat template) + completion + EOS, and the index of
    the first completion token. A self-distilled row's ``completion_ids`` (the tokens
    as the backbone generated them, EOS included where it ended) are used as they are:
    re-encoding the decoded text can give other tokens."""
    p = prompt_ids(tokenizer, row["prompt"])
    if row.get("completion_ids") is not None:
        return p + [int(t) for t in row["completion_ids"]], len(p)
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
    top_k: int = 0,
) -> FeatureCache:
    """Run the frozen backbone once over every ``{"prompt", "completion"}`` row (through
    the chat template, EOS appended) and write the feature cache; see
    :func:`build_features_from_ids`."""
    seqs = [sequence_ids(tokenizer, row) for row in rows]
    return build_features_from_ids(model, seqs, out_dir, num_heads, dtype, fingerprint, progress, top_k)


class FeatureWriter:
    """A feature cache under construction, appended one sequence at a time and
    resumable. It lives in ``<out_dir>.partial/`` (raw ``hidden.bin``, ``targets.bin``,
    optionally ``top_logprobs.bin`` and ``top_ids.bin``, ``rows.jsonl`` with one JSON
    row per sequence, and ``lengths.bin``, the positions of each sequence, written
    last as its commit mark) until :meth:`finish` converts it to ``.npy`` files and
    renames it to ``out_dir``, so nothing half-built ever looks complete.

    Args:
        out_dir: the final cache folder.
        hidden_size: H.
        num_heads: K (targets have K + 1 columns).
        dtype: "float16" or "float32" for the hidden states.
        resume: keep the whole sequences already in ``<out_dir>.partial/`` (a sequence
            cut off by a kill is truncated away); otherwise start afresh.
        top_k: also store the backbone's top-``top_k`` log-probabilities per position
            (0: none).

    Attributes:
        rows: the rows of the sequences written so far, in order.

    Raises:
        ValueError: an unknown ``dtype``, or a partial folder built for another K, H
            or top-k.
    """

    def __init__(
        self,
        out_dir: str | Path,
        hidden_size: int,
        num_heads: int,
        dtype: str = "float16",
        resume: bool = False,
        top_k: int = 0,
    ):
        if dtype not in ("float16", "float32"):
            raise ValueError(f"feature dtype must be float16 or float32, got {dtype!r}")
        self.out_dir = Path(out_dir)
        self.tmp = self.out_dir.with_name(self.out_dir.name + ".partial")
        self.H, self.K, self.dtype, self.top_k = hidden_size, num_heads, np.dtype(dtype), top_k
        if not resume:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        shape = {"hidden_size": self.H, "num_heads": self.K, "dtype": self.dtype.name}
        if top_k:
            shape["top_k"] = top_k
        spec = self.tmp / "shape.json"
        if spec.is_file() and json.loads(spec.read_text()) != shape:
            raise ValueError(f"{self.tmp}: built as {spec.read_text()}, not {shape}; delete it to rebuild")
        spec.write_text(json.dumps(shape))
        lp = self.tmp / "lengths.bin"
        raw = lp.read_bytes() if lp.is_file() else b""
        lengths = np.frombuffer(raw[: len(raw) // 8 * 8], dtype=np.int64)
        rp = self.tmp / "rows.jsonl"
        lines = _row_lines(rp.read_text(encoding="utf-8")) if rp.is_file() else []
        n = min(len(lengths), len(lines))
        self.rows = [json.loads(line) for line in lines[:n]]
        assert len(self.rows) == n, "a committed sequence without its row"
        self.sequences, self.positions = n, int(lengths[:n].sum())
        rows_bytes = sum(len(line.encode("utf-8")) for line in lines[:n])
        self._arrays = {"hidden.bin": self.H * self.dtype.itemsize, "targets.bin": (self.K + 1) * 4}
        if top_k:
            self._arrays.update({"top_logprobs.bin": top_k * 2, "top_ids.bin": top_k * 4})
        sizes = {name: self.positions * row for name, row in self._arrays.items()}
        for name, nbytes in {"lengths.bin": n * 8, "rows.jsonl": rows_bytes, **sizes}.items():
            with open(self.tmp / name, "ab") as f:
                f.truncate(nbytes)
        self._files = {n: open(self.tmp / n, "ab") for n in (*self._arrays, "rows.jsonl", "lengths.bin")}

    def _write(self, arrays: dict, rows: list[dict], positions: int) -> None:
        f = self._files
        for name, a in arrays.items():
            f[name].write(a.tobytes())
        f["rows.jsonl"].write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
        for name in (*self._arrays, "rows.jsonl"):
            f[name].flush()
        f["lengths.bin"].write(np.int64(positions).tobytes())  # the commit mark, last
        f["lengths.bin"].flush()

    def add(
        self,
        hidden: np.ndarray,
        targets: np.ndarray,
        row: dict | None = None,
        top_logprobs: np.ndarray | None = None,
        top_ids: np.ndarray | None = None,
    ) -> None:
        """Append one sequence: ``hidden`` ``(n, H)``, ``targets`` ``(n, K + 1)`` int32,
        its dataset ``row`` and, for a writer with ``top_k``, ``top_logprobs`` /
        ``top_ids`` ``(n, top_k)``. Its length is written last: a sequence counts
        only once whole.

        Raises:
            ValueError: the top-k arrays are missing or of the wrong shape.
        """
        n = targets.shape[0]
        assert hidden.shape == (n, self.H) and targets.shape[1] == self.K + 1
        arrays = {
            "hidden.bin": np.ascontiguousarray(hidden, dtype=self.dtype),
            "targets.bin": np.ascontiguousarray(targets, dtype=np.int32),
        }
        if self.top_k:
            if top_logprobs is None or top_ids is None or top_ids.shape != (n, self.top_k):
                raise ValueError(f"this feature cache stores top-{self.top_k} log-probabilities per position")
            arrays["top_logprobs.bin"] = np.ascontiguousarray(top_logprobs, dtype=np.float16)
            arrays["top_ids.bin"] = np.ascontiguousarray(top_ids, dtype=np.int32)
        self._write(arrays, [row or {}], n)
        self.rows.append(row or {})
        self.sequences += 1
        self.positions += n

    def extend(self, cache: FeatureCache) -> None:
        """Append a whole finished cache (its ``rows.jsonl`` too, when it kept one).

        Raises:
            ValueError: this writer stores top-k log-probabilities and ``cache`` has
                fewer.
        """
        assert cache.hidden.shape[1] == self.H and cache.num_heads >= self.K
        if cache.top_k < self.top_k:
            raise ValueError(f"{cache.path}: holds top-{cache.top_k} log-probabilities, not {self.top_k}")
        rp = cache.path / "rows.jsonl" if cache.path else None
        rows = (
            [json.loads(line) for line in _row_lines(rp.read_text(encoding="utf-8"))]
            if rp and rp.is_file()
            else []
        )
        f = self._files
        for i in range(0, len(cache), 65536):
            sl = slice(i, i + 65536)
            f["hidden.bin"].write(np.ascontiguousarray(cache.hidden[sl], dtype=self.dtype).tobytes())
            f["targets.bin"].write(np.ascontiguousarray(cache.targets[sl, : self.K + 1]).tobytes())
            if self.top_k:
                f["top_logprobs.bin"].write(
                    np.ascontiguousarray(cache.top_logprobs[sl, : self.top_k]).tobytes()
                )
                f["top_ids.bin"].write(np.ascontiguousarray(cache.top_ids[sl, : self.top_k]).tobytes())
        self._write({}, rows, len(cache))
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
        columns = {
            "hidden": (self.dtype, self.H),
            "targets": (np.dtype(np.int32), self.K + 1),
            "top_logprobs": (np.dtype(np.float16), self.top_k),
            "top_ids": (np.dtype(np.int32), self.top_k),
        }
        for name, (dt, width) in columns.items():
            if width:
                _bin_to_npy(self.tmp / f"{name}.bin", self.tmp / f"{name}.npy", dt, (self.positions, width))
        for name in ("lengths.bin", "shape.json") + (() if keep_rows else ("rows.jsonl",)):
            (self.tmp / name).unlink()
        meta = {
            "num_heads": self.K,
            "positions": self.positions,
            "sequences": self.sequences,
            "dtype": self.dtype.name,
            "top_k": self.top_k,
            "fingerprint": fingerprint or {},
        }
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        os.replace(self.tmp, self.out_dir)
        return load_features(self.out_dir)


def teacher_forced(
    model,
    sequences: Sequence[tuple[Sequence[int], int]],
    top_k: int = 0,
    tokens_per_pass: int = 4096,
) -> Iterator[tuple[int, np.ndarray, np.ndarray | None, np.ndarray | None]]:
    """The frozen backbone's features over given text, at prefill speed: sequences
    of similar length are right-padded into one batch (causal attention never looks
    at the padding after a token, so no mask is needed) and run through the backbone
    in chunks of at most ``tokens_per_pass`` tokens (batch x columns).

    Args:
        model: a :class:`mlx_stream.model.SpeculativeModel`.
        sequences: ``(ids, start)`` pairs; positions ``start - 1 .. len(ids) - 2`` are
            kept (those whose next token is from ``start`` on).
        top_k: also return the top-``top_k`` next-token log-probabilities (0: none).
        tokens_per_pass: bounds a pass's batch x columns (memory).

    Yields:
        ``(index, hidden, top_logprobs, top_ids)`` per sequence with at least one kept
        position, shortest sequences first: ``hidden`` ``(n, H)`` float16,
        ``top_logprobs`` ``(n, top_k)`` float16 and ``top_ids`` ``(n, top_k)`` int32
        (None without ``top_k``).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from .generation import top_k_logprobs

    bb, family = model.backbone, model.family
    order = sorted(
        (i for i, (ids, s) in enumerate(sequences) if len(ids) - s >= 1), key=lambda i: len(sequences[i][0])
    )
    k = 0
    while k < len(order):
        width = len(sequences[order[k]][0])
        group = [order[k]]  # lengths within ~1/8 of the first, as many as a pass holds
        while (
            k + len(group) < len(order)
            and len(sequences[order[k + len(group)]][0]) <= width * 9 // 8 + 2
            and (len(group) + 1) * len(sequences[order[k + len(group)]][0]) <= max(tokens_per_pass, width)
        ):
            group.append(order[k + len(group)])
        k += len(group)
        width = max(len(sequences[i][0]) for i in group)
        x = mx.array([list(sequences[i][0]) + [0] * (width - len(sequences[i][0])) for i in group])
        cache = make_prompt_cache(bb)
        cols = max(tokens_per_pass // len(group), 1)
        hs, lps, tis = [], [], []
        for c in range(0, width, cols):
            h = bb.model(x[:, c : c + cols], cache=cache)  # (B, cols, H)
            out = [h.astype(mx.float16)]
            if top_k:
                logits = family.project(bb, h).astype(mx.float32)
                out += top_k_logprobs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), top_k)
            mx.eval(out, [cc.state for cc in cache])
            hs.append(np.array(out[0]))
            if top_k:
                lps.append(np.array(out[1].astype(mx.float16)))
                tis.append(np.array(out[2]))
        hs = np.concatenate(hs, axis=1)
        lps = np.concatenate(lps, axis=1) if top_k else None
        tis = np.concatenate(tis, axis=1) if top_k else None
        for b, i in enumerate(group):
            ids, start = sequences[i]
            sl = slice(max(start - 1, 0), len(ids) - 1)
            yield i, hs[b, sl], (lps[b, sl] if top_k else None), (tis[b, sl] if top_k else None)


def build_features_from_ids(
    model,
    sequences,
    out_dir: str | Path,
    num_heads: int,
    dtype: str = "float16",
    fingerprint: dict | None = None,
    progress=None,
    top_k: int = 0,
) -> FeatureCache:
    """Run the frozen backbone once over ``(ids, start)`` sequences (positions from
    ``start - 1`` on are kept; batched, :func:`teacher_forced`) and write the feature
    cache (through a :class:`FeatureWriter`, so an interrupted build leaves nothing
    that looks complete).

    Raises:
        ValueError: an unknown ``dtype`` or no usable rows.
    """
    sequences = list(sequences)
    writer = FeatureWriter(out_dir, model.state_size, num_heads, dtype, top_k=top_k)
    try:
        for n, (i, h, lp, ti) in enumerate(teacher_forced(model, sequences, top_k)):
            ids, start = sequences[i]
            writer.add(h, targets_for(ids, start, num_heads), None, lp, ti)
            if progress:
                progress(n + 1, writer.positions)
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


def _row_lines(text: str) -> list[str]:
    # rows.jsonl's lines with their "\n" (the last may be a killed write's part): split at "\n"
    # alone, as str.splitlines would also split at the U+0085 / U+2028 that
    # json.dumps(ensure_ascii=False) leaves inside a completion's text
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


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
    P = meta["positions"]
    if hidden.shape[0] != P or targets.shape != (P, meta["num_heads"] + 1):
        raise ValueError(f"{path}: feature files do not match meta.json (rebuild the cache)")
    top = {}
    if meta.get("top_k"):
        for name, dt in (("top_logprobs", np.float16), ("top_ids", np.int32)):
            if not (path / f"{name}.npy").is_file():
                raise FileNotFoundError(f"{path / name}.npy: feature cache file missing (rebuild the cache)")
            top[name] = np.load(path / f"{name}.npy", mmap_mode="r")
            if top[name].shape != (P, meta["top_k"]) or top[name].dtype != dt:
                raise ValueError(f"{path}: {name}.npy does not match meta.json (rebuild the cache)")
    return FeatureCache(hidden, targets, meta, path, **top)
