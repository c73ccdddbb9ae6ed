"""Writing files and folders all at once: a reader (or a run resumed after a kill) sees
the old version or the new one, never half of one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """Where mlx-stream keeps what it converts and measures (models, costs, calibrations,
    answers): ``$MLX_STREAM_CACHE`` or ``~/.cache/mlx-stream``."""
    return Path(os.environ.get("MLX_STREAM_CACHE", Path.home() / ".cache" / "mlx-stream"))


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``.

    On any error (or an interrupt) the temporary file is removed and ``path`` is left
    as it was. The parent folder is created if needed.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write`)."""
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def write_json(obj, path: str | Path) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically (:func:`atomic_write`)."""
    return write_text(path, json.dumps(obj, indent=2))


@contextmanager
def staged_folder(out: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out`` to fill; when the block ends without an
    error it takes the place of ``out``, otherwise it is removed.

    Args:
        out: the folder to write.
        replace: an existing ``out`` is replaced (it is moved aside, the new folder
            renamed in, then the old one deleted; a kill in between leaves
            ``.{name}.old`` beside it). False: ``out`` must be absent or empty.

    Raises:
        ValueError: ``replace=False`` and ``out`` exists and is not an empty folder.
    """
    out = Path(out)
    if not replace and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: output folder exists and is not empty; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_writable(path: str | Path, folder: bool) -> None:
    """Refuse, before any work is done, an output path that cannot be written: the folder
    (``folder=True``) or the file's folder must exist or be creatable inside a folder
    that accepts a file. Nothing is left behind.

    Raises:
        ValueError: naming the path and the cause.
    """
    p = Path(path)
    where = p if folder else p.parent
    try:
        if p.exists() and p.is_dir() != folder:
            raise NotADirectoryError(f"{p} is {'a file' if folder else 'a folder'}")
        up = where  # nothing is created here: the nearest existing folder must take a file
        while not up.exists() and up != up.parent:
            up = up.parent
        if not up.is_dir():
            raise NotADirectoryError(f"{up} is a file")
        fd, probe = tempfile.mkstemp(dir=up, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(
            f"cannot write {'into ' if folder else ''}{p}: {e.strerror or e}; choose another --out"
        ) from e
