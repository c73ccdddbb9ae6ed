"""A datastore of the model's own outputs: drafts retrieved from past text.

A model's answers repeat across conversations: its phrasings, list formats, code
idioms. A suffix index over earlier outputs finds where the current context's last
few tokens occurred before and proposes what most often followed (REST, He et al.
2023, retrieval-based speculative decoding; SuffixDecoding, Oliaro et al. 2024).

The index is a sorted array of positions keyed by the reversed n-gram that ends at
each position (the token, the one before it, ...; ``max_ngram`` deep): the positions
whose preceding text matches the context's suffix of length n form one contiguous
range, found by n binary searches, and a longer match narrows the range. The draft
is the most frequent continuation, extended token by token while it stays frequent
among the matches (a walk down the continuation trie of REST). Pure numpy.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
import zipfile
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .checks import kind, require_int, require_path, require_token_ids

SEP = -1  # between sequences: never matched, never drafted


class Datastore:
    """A suffix index over token sequences.

    Args:
        tokens: ``(T,)`` int32 token ids, sequences separated by :data:`SEP`.
        max_ngram: the longest context suffix matched.

    Attributes:
        tokens: the indexed tokens. order: ``(P,)`` positions sorted by their reversed
        n-gram keys. keys: ``(max_ngram, P)`` the sorted keys (key j: the token j
        before the position, inclusive; :data:`SEP` past a sequence's start).

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: ``max_ngram < 1``.
    """

    def __init__(self, tokens: np.ndarray, max_ngram: int = 8):
        require_int(max_ngram, "max_ngram", 1)
        if not isinstance(tokens, np.ndarray):
            require_token_ids(tokens, "tokens")
        elif tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D array of integer token ids, got shape {tokens.shape} {tokens.dtype}"
            )
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.max_ngram = max_ngram
        T = len(self.tokens)
        # positions whose continuation exists and that are not separators themselves
        pos = np.flatnonzero((self.tokens != SEP)[: max(T - 1, 0)] & (self.tokens[1:] != SEP)).astype(
            np.int64
        )
        cols = []
        prev_ok = np.ones(len(pos), dtype=bool)
        for j in range(max_ngram):
            idx = pos - j
            ok = prev_ok & (idx >= 0)
            col = np.full(len(pos), SEP, dtype=np.int32)
            col[ok] = self.tokens[idx[ok]]
            ok &= col != SEP
            col[~ok] = SEP
            cols.append(col)
            prev_ok = ok
        order = np.lexsort(cols[::-1]) if len(pos) else np.zeros(0, dtype=np.int64)
        self.order = pos[order]
        self.keys = np.stack([c[order] for c in cols]) if len(pos) else np.zeros((max_ngram, 0), np.int32)

    @classmethod
    def from_sequences(cls, sequences: Iterable[Sequence[int]], max_ngram: int = 8) -> Datastore:
        """Index token sequences (each a list of ids), separated by :data:`SEP`."""
        parts: list[np.ndarray] = []
        for s in sequences:
            if len(s):
                parts += [np.asarray(s, dtype=np.int32), np.array([SEP], dtype=np.int32)]
        return cls(np.concatenate(parts) if parts else np.zeros(0, np.int32), max_ngram)

    def match(self, context: Sequence[int], min_ngram: int = 2) -> tuple[int, int, int]:
        """The longest suffix of ``context`` (at most ``max_ngram`` tokens, at least
        ``min_ngram``) found in the store: ``(n, lo, hi)``, its length and the range of
        :attr:`order` holding its occurrences; ``(0, 0, 0)`` when none."""
        lo, hi, best = 0, len(self.order), (0, 0, 0)
        ctx = list(context)[-self.max_ngram :][::-1]
        for j, t in enumerate(ctx):
            if t == SEP:
                break
            col = self.keys[j]
            a = lo + int(np.searchsorted(col[lo:hi], t, side="left"))
            b = lo + int(np.searchsorted(col[lo:hi], t, side="right"))
            if a >= b:
                break
            lo, hi = a, b
            if j + 1 >= min_ngram:
                best = (j + 1, lo, hi)
        return best

    def positions(self, context: Sequence[int], min_ngram: int = 2, max_matches: int = 256):
        """``(n, at)``: the length of the longest matched suffix of ``context`` and where
        the continuations of its latest ``max_matches`` occurrences start (``(P,)`` int64
        indices into :attr:`tokens`, ascending); ``(0, empty)`` when none."""
        n, lo, hi = self.match(context, min_ngram)
        if not n:
            return 0, np.zeros(0, np.int64)
        return n, np.sort(self.order[lo:hi])[-max_matches:] + 1

    def lookup(
        self,
        context: Sequence[int],
        num_draft: int,
        min_ngram: int = 2,
        min_share: float = 0.3,
        max_matches: int = 256,
    ) -> list[int]:
        """The draft: the most frequent continuation of the context's longest matched
        suffix, extended while its token keeps at least ``min_share`` of the matches
        that reach it (and at least two of them after the first token).

        Args:
            context: the whole context, the last emitted token last.
            num_draft: most tokens (>= 0).
            max_matches: occurrences considered at most (the latest ones).

        Returns:
            The drafted tokens (empty when nothing matched).
        """
        return lookup_many([self], context, num_draft, min_ngram, min_share, max_matches)

    def lookup_ngram(self, context, num_draft: int, min_ngram: int = 2, **kw) -> tuple[int, list[int]]:
        """:meth:`lookup` and the length of the suffix it matched (:func:`lookup_ngram`)."""
        return lookup_ngram([self], context, num_draft, min_ngram, **kw)

    def __len__(self) -> int:
        return int((self.tokens != SEP).sum())


def lookup_many(
    stores: Sequence[Datastore],
    context: Sequence[int],
    num_draft: int,
    min_ngram: int = 2,
    min_share: float = 0.3,
    max_matches: int = 256,
) -> list[int]:
    """:meth:`Datastore.lookup` over several stores as one: the longest suffix matched
    in any of them, its continuations counted over every store that matches it that long.

    Returns:
        The drafted tokens (empty when nothing matched or ``num_draft`` <= 0).
    """
    return lookup_ngram(stores, context, num_draft, min_ngram, min_share, max_matches)[1]


def lookup_ngram(
    stores: Sequence[Datastore],
    context: Sequence[int],
    num_draft: int,
    min_ngram: int = 2,
    min_share: float = 0.3,
    max_matches: int = 256,
) -> tuple[int, list[int]]:
    """:func:`lookup_many` and the length of the suffix it matched: ``(n, tokens)``
    (``(0, [])`` when nothing matched or ``num_draft`` <= 0)."""
    if num_draft <= 0:
        return 0, []
    found = [(s, *s.positions(context, min_ngram, max_matches)) for s in stores]
    n = max((f[1] for f in found), default=0)
    if not n:
        return 0, []
    runs = [(s.tokens, at) for s, m, at in found if m == n]
    out: list[int] = []
    for d in range(num_draft):
        nxts = []
        for i, (toks, at) in enumerate(runs):
            at = at[at + d < len(toks)]
            nxt = toks[at + d]
            keep = nxt != SEP
            runs[i] = toks, at[keep]
            nxts.append(nxt[keep])
        nxt = np.concatenate(nxts)
        if not len(nxt):
            break
        vals, counts = np.unique(nxt, return_counts=True)
        best = int(np.argmax(counts))
        if counts[best] < min_share * len(nxt) or (d > 0 and counts[best] < 2 and n < 4):
            break  # a rare continuation, or a single short-match occurrence past its first token
        out.append(int(vals[best]))
        runs = [(toks, at[toks[at + d] == vals[best]]) for toks, at in runs]
    return (n if out else 0), out


def save_store(store: Datastore, path, tokenizer_hash: str) -> Path:
    """Write ``store``'s tokens to an ``.npz`` (atomically, compressed), with the hash
    of the tokenizer they are ids of (``backbone_fingerprint(...)["tokenizer"]``)."""
    return _write_tokens(store.tokens, path, tokenizer_hash, store.max_ngram)


def _write_tokens(
    tokens: np.ndarray, path, tokenizer_hash: str, max_ngram: int, compress: bool = True
) -> Path:
    from .files import atomic_write

    save = np.savez_compressed if compress else np.savez  # (compressing 1M tokens: ~1 s; not: ~20 ms)

    def write(tmp):
        with open(tmp, "wb") as f:
            save(f, tokens=tokens, tokenizer=np.array(tokenizer_hash), max_ngram=np.array(max_ngram))

    return atomic_write(path, write)


def read_tokens(path, tokenizer_hash: str | None = None) -> tuple[np.ndarray, int]:
    """The ``(tokens, max_ngram)`` of a store written by :func:`save_store`.

    Raises:
        FileNotFoundError: no such file.
        OSError: the file cannot be opened (permissions, a folder in its place).
        ValueError: not a store (its content named), or built for another tokenizer.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: datastore not found")
    with open(path, "rb") as f:  # (opened here: numpy leaks a file it opens itself)
        try:
            with np.load(f, allow_pickle=False) as z:
                tokens, tok, max_ngram = z["tokens"], str(z["tokenizer"]), int(z["max_ngram"])
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(
                f"{path}: not a readable datastore (not an .npz file: {type(e).__name__})"
            ) from e
        except KeyError as e:
            raise ValueError(f"{path}: not a readable datastore (no {e} in it)") from e
    if tokens.ndim != 1 or tokens.dtype.kind != "i" or (len(tokens) and int(tokens.min()) < SEP):
        raise ValueError(f"{path}: not a readable datastore (tokens must be a 1-D array of ids >= -1)")
    if max_ngram < 1:
        raise ValueError(f"{path}: not a readable datastore (max_ngram {max_ngram} < 1)")
    if tokenizer_hash is not None and tok != tokenizer_hash:
        raise ValueError(
            f"{path}: a datastore of token ids of tokenizer {tok}, but the model's tokenizer is "
            f"{tokenizer_hash}; rebuild it for this model"
        )
    return tokens.astype(np.int32, copy=False), max_ngram


def load_store(path, tokenizer_hash: str | None = None) -> Datastore:
    """Read a store written by :func:`save_store` and rebuild its index.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable store, or built for another tokenizer (both named).
    """
    return Datastore(*read_tokens(path, tokenizer_hash))


def keep_latest(tokens: np.ndarray, max_tokens: int) -> np.ndarray:
    """The latest whole sequences of ``tokens`` (separated by :data:`SEP`) that fit in
    ``max_tokens`` (separators included); the tail alone if the last one is longer."""
    if len(tokens) <= max_tokens:
        return tokens
    cut = len(tokens) - max_tokens  # the first index that may be kept
    seps = np.flatnonzero(tokens[cut - 1 :] == SEP)
    return tokens[cut + seps[0] :] if len(seps) and cut + seps[0] < len(tokens) else tokens[cut:]


STORE_FILE = "datastore.npz"  # beside a heads folder's config.json
ANSWER_TOKENS = 1 << 20  # this machine's store of a model's answers keeps the latest 1M tokens


def learn_setting() -> bool:
    """Whether the command line drafts from and adds to this machine's store of the
    model's answers when neither ``--learn`` nor ``--no-learn`` is given: on, unless
    ``MLX_STREAM_LEARN`` is ``0``, ``off``, ``false`` or ``no``.

    Raises:
        ValueError: ``MLX_STREAM_LEARN`` is set to anything else than those or ``1``,
            ``on``, ``true``, ``yes``.
    """
    value = os.environ.get("MLX_STREAM_LEARN", "1").strip().lower()
    if value not in ("1", "on", "true", "yes", "0", "off", "false", "no"):
        raise ValueError(f"MLX_STREAM_LEARN={value!r}: use 1/on/true/yes or 0/off/false/no")
    return value in ("1", "on", "true", "yes")


def answers_path(fingerprint: dict, root: str | Path) -> Path:
    """Where this machine keeps a model's past answers: ``<root>/answers/<model>.npz``,
    one file per backbone (``fingerprint``: :func:`mlx_stream.heads.backbone_fingerprint`;
    ``root``: the cache folder, :func:`mlx_stream.loader.cache_dir`)."""
    name = f"{fingerprint['architecture']}-{fingerprint['tokenizer']}-{fingerprint['weights']}.npz"
    return Path(root) / "answers" / name


class AnswerStore:
    """This machine's store of one model's answers, grown by its generations.

    One ``.npz`` file (:func:`save_store`'s format, uncompressed: 4 MB at the 1M-token
    bound, rewritten in ~20 ms) of the answers' token ids, oldest first, at most
    ``max_tokens`` of them (the oldest answers are dropped first).
    Appending reads, extends and rewrites the file atomically under an exclusive lock
    on ``<file>.lock`` (``fcntl.flock``), so two processes appending at once lose
    nothing and a reader never sees half a file (readers take a shared lock, or none
    where the folder is read-only). A file that is not a store, or was written for
    another tokenizer, is moved aside to ``<file>.bad-<time>`` with a warning and the
    store starts empty; one that cannot be opened (permissions) is left alone and
    raises ``OSError``. Only what the model wrote is stored, never the prompts.

    Args:
        path: the file (:func:`answers_path`).
        tokenizer_hash: the model's tokenizer (``backbone_fingerprint(...)["tokenizer"]``).
        max_tokens: the bound (>= 1).

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
        ValueError: ``max_tokens < 1``.
        OSError: from :meth:`read`, :meth:`append`, :meth:`clear`: the file or its
            folder cannot be read or written.
    """

    def __init__(self, path: str | Path, tokenizer_hash: str, max_tokens: int = ANSWER_TOKENS):
        require_path(path)
        if not isinstance(tokenizer_hash, str):
            raise TypeError(
                "tokenizer_hash must be a str (a backbone fingerprint's 'tokenizer'), "
                f"got {kind(tokenizer_hash)}"
            )
        require_int(max_tokens, "max_tokens", 1)
        self.path, self.tokenizer_hash, self.max_tokens = Path(path), tokenizer_hash, max_tokens

    @contextmanager
    def _locked(self, exclusive: bool = True):
        import fcntl

        lock = self.path.with_name(self.path.name + ".lock")
        try:
            if exclusive:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(lock, "a+b")
        except OSError:
            if exclusive:
                raise
            yield  # a read-only folder: nobody can be writing there
            return
        with f:
            fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _read(self) -> np.ndarray:
        if not self.path.is_file():
            return np.zeros(0, np.int32)
        try:
            return read_tokens(self.path, self.tokenizer_hash)[0]
        except ValueError as e:
            stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            aside = self.path.with_name(f"{self.path.name}.bad-{stamp}")
            try:
                os.replace(self.path, aside)
            except OSError as err:  # a read-only folder: ignored, left where it is
                warnings.warn(f"{e}; ignored (cannot move it aside: {err})", stacklevel=3)
            else:
                warnings.warn(f"{e}; moved aside to {aside}, starting an empty store", stacklevel=3)
            return np.zeros(0, np.int32)

    def read(self) -> np.ndarray:
        """The stored tokens, ``(T,)`` int32, answers separated by :data:`SEP`."""
        with self._locked(exclusive=False):
            return self._read()

    def append(self, answers: Iterable[Sequence[int]]) -> int:
        """Add answers (token id lists; empty ones are skipped); returns the tokens now stored."""
        new = [np.asarray(a, np.int32) for a in answers if len(a)]
        with self._locked():
            tokens = self._read()
            if not new:
                return int((tokens != SEP).sum())
            parts = [tokens] + [x for a in new for x in (a, np.array([SEP], np.int32))]
            tokens = keep_latest(np.concatenate(parts), self.max_tokens)
            _write_tokens(tokens, self.path, self.tokenizer_hash, 8, compress=False)
            return int((tokens != SEP).sum())

    def clear(self) -> bool:
        """Delete the stored answers; True if there were any."""
        with self._locked():
            had = self.path.is_file()
            if had:
                self.path.unlink()
            return had


class DraftStore:
    """The datastore a model drafts from: the store shipped with its heads, this
    machine's :class:`AnswerStore` of its answers (as read at load), and the answers of
    this session (:meth:`remember`), looked up as one (:func:`lookup_many`).

    Args:
        shipped: the heads' :class:`Datastore`, or None.
        answers: this machine's :class:`AnswerStore`, or None.
        learn: :meth:`remember` adds answers (to this session's index and the
            ``answers`` file); False: the stores are read only, as benchmarks need
            (a measurement must not feed on its own outputs).
        max_ngram: the longest suffix matched in the answers' and session's indices.
        more: other indices looked up with these (e.g. a benchmark's store of other answers).

    Attributes:
        parts: the indices looked up.

    Raises:
        TypeError: an argument of the wrong kind (the message names the accepted forms).
    """

    def __init__(
        self,
        shipped: Datastore | None = None,
        answers: AnswerStore | None = None,
        learn: bool = True,
        max_ngram: int = 8,
        more: Sequence[Datastore] = (),
    ):
        for name, value, cls in (("shipped", shipped, Datastore), ("answers", answers, AnswerStore)):
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"{name} must be a {cls.__name__} or None, got {kind(value)}")
        if (
            isinstance(more, (str, bytes))
            or not isinstance(more, Sequence)
            or not all(isinstance(m, Datastore) for m in more)
        ):
            raise TypeError("more must be a sequence of Datastore")
        if not isinstance(learn, bool):
            raise TypeError(f"learn must be True or False, got {kind(learn)}")
        require_int(max_ngram, "max_ngram", 1)
        self.shipped, self.answers, self.learn, self.max_ngram = shipped, answers, learn, max_ngram
        self._base = [shipped] if shipped is not None and len(shipped) else []
        if answers is not None:
            try:
                past = Datastore(answers.read(), max_ngram)
            except OSError as e:  # unreadable (permissions): decoding goes on without it
                warnings.warn(f"{answers.path}: cannot read the stored answers ({e})", stacklevel=2)
                past = Datastore(np.zeros(0, np.int32), max_ngram)
            if len(past):
                self._base.append(past)
        self._base += [m for m in more if len(m)]
        self._session: list[np.ndarray] = []
        self._recent: Datastore | None = None

    @property
    def parts(self) -> list[Datastore]:
        return self._base + ([self._recent] if self._recent is not None else [])

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def lookup(self, context, num_draft: int, min_ngram: int = 2, **kw) -> list[int]:
        """As :meth:`Datastore.lookup`, over :attr:`parts`."""
        return lookup_many(self.parts, context, num_draft, min_ngram, **kw)

    def lookup_ngram(self, context, num_draft: int, min_ngram: int = 2, **kw) -> tuple[int, list[int]]:
        """As :func:`lookup_ngram`, over :attr:`parts`."""
        return lookup_ngram(self.parts, context, num_draft, min_ngram, **kw)

    def remember(self, answer: Sequence[int]) -> None:
        """Add one answer's tokens (when ``learn``): drafted from for the rest of the
        session and appended to the answers file. An unwritable answers file only
        warns (decoding goes on)."""
        if not len(answer) or not self.learn:
            return
        self._session.append(np.asarray(answer, np.int32))
        self._recent = Datastore.from_sequences(self._session, self.max_ngram)
        if self.answers is not None:
            try:
                self.answers.append([answer])
            except OSError as e:
                warnings.warn(f"{self.answers.path}: could not store this answer ({e})", stacklevel=2)
