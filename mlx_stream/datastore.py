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

from collections.abc import Iterable, Sequence

import numpy as np

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
        ValueError: ``max_ngram < 1``.
    """

    def __init__(self, tokens: np.ndarray, max_ngram: int = 8):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
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

    def __len__(self) -> int:
        return int((self.tokens != SEP).sum())

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
        n, lo, hi = self.match(context, min_ngram)
        if not n or num_draft <= 0:
            return []
        at = np.sort(self.order[lo:hi])[-max_matches:] + 1  # where each occurrence's continuation starts
        out: list[int] = []
        T = len(self.tokens)
        for d in range(num_draft):
            at = at[at + d < T]
            nxt = self.tokens[at + d]
            keep = nxt != SEP
            at, nxt = at[keep], nxt[keep]
            if not len(nxt):
                break
            vals, counts = np.unique(nxt, return_counts=True)
            best = int(np.argmax(counts))
            if counts[best] < min_share * len(nxt) or (d > 0 and counts[best] < 2 and n < 4):
                break  # a rare continuation, or a single short-match occurrence past its first token
            out.append(int(vals[best]))
            at = at[nxt == vals[best]]
        return out


def save_store(store: Datastore, path, tokenizer_hash: str):
    """Write ``store``'s tokens to an ``.npz`` (atomically), with the hash of the
    tokenizer they are ids of (``backbone_fingerprint(...)["tokenizer"]``)."""
    from .files import atomic_write

    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(
                f,
                tokens=store.tokens,
                tokenizer=np.array(tokenizer_hash),
                max_ngram=np.array(store.max_ngram),
            )

    return atomic_write(path, write)


def load_store(path, tokenizer_hash: str | None = None) -> Datastore:
    """Read a store written by :func:`save_store` and rebuild its index.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable store, or built for another tokenizer (both named).
    """
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: datastore not found")
    try:
        with np.load(path, allow_pickle=False) as z:
            tokens, tok, max_ngram = z["tokens"], str(z["tokenizer"]), int(z["max_ngram"])
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: not a readable datastore ({e})") from e
    if tokenizer_hash is not None and tok != tokenizer_hash:
        raise ValueError(
            f"{path}: a datastore of token ids of tokenizer {tok}, but the model's tokenizer is "
            f"{tokenizer_hash}; rebuild it for this model"
        )
    return Datastore(tokens, max_ngram)
