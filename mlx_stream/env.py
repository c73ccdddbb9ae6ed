"""Facts about the runtime environment that change speed (not results)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def openblas_loaded() -> bool:
    """True when OpenBLAS is mapped into this process (Linux only)."""
    try:
        return "openblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def blas_hint() -> str | None:
    """One line saying how to enable the fast CPU path, or ``None`` when it is on
    (or irrelevant: macOS uses Accelerate / Metal).

    The mlx-cpu wheel links the reference BLAS; float32 matmuls are about 20x faster
    with OpenBLAS preloaded and one BLAS thread.
    """
    if not sys.platform.startswith("linux") or openblas_loaded():
        return None
    lib = OPENBLAS if os.path.exists(OPENBLAS) else "<path to libopenblas.so.0>"
    prefix = "" if os.path.exists(OPENBLAS) else "apt-get install libopenblas0-pthread; then "
    return (
        f"note: slow reference BLAS in use; for ~20x faster float32 matmuls: {prefix}"
        f"export LD_PRELOAD={lib} OPENBLAS_NUM_THREADS=1"
    )
