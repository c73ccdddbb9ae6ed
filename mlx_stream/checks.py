"""Argument checks for the public API: a wrong kind of argument is refused where it enters,
with a ``TypeError``/``ValueError`` that names the accepted forms, rather than an
``AttributeError`` from deep inside a forward pass."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence


def kind(value) -> str:
    """How an error message names a value the caller passed."""
    return "None" if value is None else type(value).__name__


def require_tokenizer(tokenizer, name: str = "tokenizer") -> None:
    """``tokenizer`` must be an mlx-lm ``TokenizerWrapper`` (what :func:`~mlx_stream.load`
    and ``mlx_lm.load`` return).

    Raises:
        TypeError: anything else.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        raise TypeError(
            f"{name} must be the tokenizer that mlx_stream.load (or mlx_lm.load) returns, an mlx-lm "
            f"TokenizerWrapper; got {kind(tokenizer)}"
        )


def require_path(path, name: str = "path") -> None:
    """``path`` must be a ``str`` or an ``os.PathLike`` (not bytes, not empty).

    Raises:
        TypeError: another kind. ValueError: an empty string.
    """
    if isinstance(path, (bytes, bytearray)) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or pathlib.Path, got {kind(path)}")
    if str(path) == "":
        raise ValueError(f"{name} must not be empty")


def require_int(value, name: str, minimum: int | None = None) -> None:
    """``value`` must be an ``int`` (not a bool), at least ``minimum`` when given.

    Raises:
        TypeError: another kind. ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {kind(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def require_token_ids(ids, name: str) -> None:
    """``ids`` must be a sequence of non-negative ``int`` token ids (numpy integers too).

    Raises:
        TypeError: not a sequence, or an element that is not an integer.
        ValueError: a negative id.
    """
    import numpy as np

    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a sequence of token ids (ints), got {kind(ids)}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{name} must hold token ids (ints), got an element of type {kind(t)}")
        if t < 0:
            raise ValueError(f"{name}: token ids are >= 0, got {int(t)}")


def require_number(value, name: str) -> None:
    """``value`` must be a real number (an int or a float, not a bool).

    Raises:
        TypeError: another kind.
    """
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {kind(value)}")


def require_drafter(drafter, name: str = "drafter") -> None:
    """``drafter`` must have the :class:`~mlx_stream.drafters.Drafter` interface: a ``tree``
    and ``draft`` (or ``propose``, :class:`~mlx_stream.drafters.TreeProposer`).

    Raises:
        TypeError: anything else.
    """
    if not hasattr(drafter, "tree") or not (hasattr(drafter, "draft") or hasattr(drafter, "propose")):
        raise TypeError(
            f"{name} must be a Drafter (mlx_stream.make_drafter(model), NoDrafter(), HeadsDrafter, ...), "
            f"got {kind(drafter)}"
        )


def check_p_min(p_min) -> None:
    """``p_min`` (a draft model's early stop) must be None or a number in [0, 1).

    Raises:
        TypeError: another kind. ValueError: out of range.
    """
    if p_min is None:
        return
    require_number(p_min, "p_min")
    if not 0.0 <= p_min < 1.0:
        raise ValueError(f"p_min must be in [0, 1) (0: draft to the full depth), got {p_min}")


def require_unicode(text: str, name: str) -> None:
    """``text`` must encode as UTF-8: no lone surrogates (what Python makes of bytes that
    are not UTF-8 when it decodes them with ``errors="surrogateescape"``, as it does for
    command-line arguments). The tokenizer would fail on them with a ``TypeError`` that
    names neither the text nor the fix.

    Raises:
        ValueError: a lone surrogate; the message names where it is and how to clean it.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} is not valid Unicode text: {e.reason} {text[e.start]!r} at character {e.start} "
            "(bytes that are not UTF-8?); decode bytes with errors='replace' first"
        ) from None


def replace_invalid_utf8(text: str) -> tuple[str, int]:
    """``text`` with every lone surrogate (a byte that was not UTF-8, as Python's
    ``surrogateescape`` hands it over in ``sys.argv``) replaced by U+FFFD, and how many were.

    Returns:
        ``(clean_text, replaced)``; ``replaced`` is 0 when ``text`` was valid.
    """
    return _SURROGATE.subn("\ufffd", text)


_SURROGATE = re.compile("[\ud800-\udfff]")
