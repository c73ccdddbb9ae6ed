"""Writing a model folder all at once."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def staged_folder(out: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``out`` to fill; when the block ends without an
    error it is renamed to ``out`` (which must be absent or empty), otherwise removed.
    A failed or interrupted conversion therefore leaves nothing behind.

    Raises:
        ValueError: ``out`` exists and is not an empty folder.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: output folder exists and is not empty; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
