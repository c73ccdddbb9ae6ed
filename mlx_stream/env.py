"""Facts about the runtime environment that change speed (not results).

On Linux the mlx-cpu wheel links the reference (netlib) BLAS that it bundles in
``mlx_cpu.libs``; float32 matmuls are about 20x faster when OpenBLAS provides MLX's
``cblas_sgemm`` instead (``LD_PRELOAD`` of the system OpenBLAS, one BLAS thread).

Which library MLX really calls cannot be told from ``/proc/self/maps``: numpy and scipy
map their own bundled OpenBLAS (``libscipy_openblas*``, with prefixed symbols) into the
process, but MLX never binds to it. :func:`mlx_blas` asks the dynamic linker instead.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Sequence

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"

#: The BLAS symbol that MLX's float32 matmul calls (``nm -D libmlx.so``: undefined
#: ``cblas_sgemm``, ``cblas_dgemm``, ``cblas_cgemm``).
BLAS_SYMBOL = "cblas_sgemm"

#: Set in the environment of the process that :func:`reexec_with_openblas` starts, so
#: that it re-executes at most once.
REEXEC_ENV = "MLX_STREAM_REEXEC"

#: Set to ``1`` to stop :func:`reexec_with_openblas` from re-executing.
NO_REEXEC_ENV = "MLX_STREAM_NO_REEXEC"


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _libdl():
    """The process's ``dlsym``/``dladdr``/``dlopen``/``dlclose`` with their C types
    (glibc >= 2.34 has them in libc, older ones in libdl), or ``None``."""
    import ctypes.util

    for name in (None, ctypes.util.find_library("dl")):
        try:
            lib = ctypes.CDLL(name)
            lib.dlsym, lib.dladdr, lib.dlopen, lib.dlclose  # noqa: B018 (all present?)
        except (OSError, AttributeError, TypeError):
            continue
        lib.dlsym.restype = ctypes.c_void_p
        lib.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.dladdr.restype = ctypes.c_int
        lib.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        lib.dlopen.restype = ctypes.c_void_p
        lib.dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.dlclose.restype = ctypes.c_int
        lib.dlclose.argtypes = [ctypes.c_void_p]
        return lib
    return None


def _file_of(dl, addr: int | None) -> str | None:
    """The path of the loaded object that contains ``addr`` (``dladdr``)."""
    if not addr:
        return None
    info = _DlInfo()
    if not dl.dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def _global_blas(dl) -> str | None:
    """The object that provides :data:`BLAS_SYMBOL` in the global scope (the main program
    and its dependencies, ``LD_PRELOAD``, ``/etc/ld.so.preload``, ``RTLD_GLOBAL`` loads),
    or ``None``. The dynamic linker searches this scope first, so it wins over any
    library's own dependencies."""
    return _file_of(dl, dl.dlsym(None, BLAS_SYMBOL.encode()))  # None = RTLD_DEFAULT


def _exports(dl, path: str, symbol: str) -> bool:
    """Whether the already loaded object ``path`` (or its dependencies) defines ``symbol``."""
    handle = dl.dlopen(os.fsencode(path), os.RTLD_LAZY | os.RTLD_NOLOAD)
    if not handle:
        return False
    try:
        return bool(dl.dlsym(handle, symbol.encode()))
    finally:
        dl.dlclose(handle)


def _is_openblas(dl, path: str) -> bool:
    return (
        _exports(dl, path, "openblas_get_config")
        or "openblas" in os.path.basename(os.path.realpath(path)).lower()
    )


def mlx_blas() -> str | None:
    """The shared library whose ``cblas_sgemm`` MLX calls for its float32 matmuls.

    Imports ``mlx.core`` (which loads ``libmlx.so``), then asks the dynamic linker what it
    bound ``libmlx.so``'s undefined ``cblas_sgemm`` to, the way it binds it: the global
    scope first (an ``LD_PRELOAD``-ed library wins there), else the local scope of the
    ``mlx.core`` extension, i.e. ``libmlx.so``'s own dependencies (the wheel's bundled
    reference ``libblas``). Libraries that numpy/scipy load privately (their bundled
    OpenBLAS) are in neither, and are rightly not reported.

    Returns:
        The path as the dynamic linker names it (e.g.
        ``/usr/lib/x86_64-linux-gnu/libopenblas.so.0`` or
        ``.../mlx/lib/../../mlx_cpu.libs/libblas-<hash>.so.3.10.0``), or ``None`` when it
        cannot be told: not Linux (macOS MLX uses Accelerate), MLX not installed, or no
        ``dlsym``/``dladdr``.

    Never raises. (A library with ``cblas_sgemm`` loaded ``RTLD_GLOBAL`` *after* MLX
    would be reported although MLX bound earlier; nothing in this package does that.)
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import mlx.core as mx
    except ImportError:
        return None
    dl = _libdl()
    if dl is None:
        return None
    found = _global_blas(dl)
    if found:
        return found
    core = getattr(mx, "__file__", None)
    handle = dl.dlopen(os.fsencode(core), os.RTLD_LAZY | os.RTLD_NOLOAD) if core else None
    if not handle:
        return None
    try:
        return _file_of(dl, dl.dlsym(handle, BLAS_SYMBOL.encode()))
    finally:
        dl.dlclose(handle)


def openblas_active() -> bool:
    """Whether MLX's matmuls run on OpenBLAS (the fast CPU path on Linux).

    Returns:
        True when the library named by :func:`mlx_blas` is an OpenBLAS (it exports
        ``openblas_get_config``); False otherwise, including on macOS and when it cannot
        be told. Imports ``mlx.core``; never raises.
    """
    lib = mlx_blas()
    if lib is None:
        return False
    dl = _libdl()
    return dl is not None and _is_openblas(dl, lib)


def openblas_path() -> str | None:
    """The system OpenBLAS to preload, or ``None`` when there is none (or not Linux).

    Looks in the Debian/Ubuntu multiarch places for this machine (``libopenblas.so.0``,
    then its ``openblas-pthread`` variant), then ``/usr/lib64`` and ``/usr/lib``.
    Returns the first path that exists; never raises.
    """
    if not sys.platform.startswith("linux"):
        return None
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())
    multiarch = f"/usr/lib/{arch}-linux-gnu"
    for path in (
        f"{multiarch}/libopenblas.so.0",
        f"{multiarch}/openblas-pthread/libopenblas.so.0",
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",
    ):
        if os.path.exists(path):
            return path
    return None


def blas_hint() -> str | None:
    """One line saying how to enable the fast CPU path, or ``None`` when it is on
    (or irrelevant: macOS uses Accelerate / Metal).

    The mlx-cpu wheel links the reference BLAS; float32 matmuls are about 20x faster
    with OpenBLAS preloaded and one BLAS thread. Based on :func:`openblas_active`
    (imports ``mlx.core``); never raises.
    """
    if not sys.platform.startswith("linux") or openblas_active():
        return None
    found = openblas_path()
    lib = found or "<path to libopenblas.so.0>"
    prefix = "" if found else "apt-get install libopenblas0-pthread; then "
    return (
        f"note: slow reference BLAS in use; for ~20x faster float32 matmuls: {prefix}"
        f"export LD_PRELOAD={lib} OPENBLAS_NUM_THREADS=1"
    )


def _openblas_bound_or_first() -> bool:
    """Whether MLX is (if loaded) or will be (if not yet) bound to OpenBLAS, without
    importing MLX: with ``mlx.core`` imported this is :func:`openblas_active`; before,
    it is whether the global scope (``LD_PRELOAD`` etc.) already provides an OpenBLAS
    ``cblas_sgemm``, which is what ``libmlx.so`` will bind to when it loads."""
    if "mlx.core" in sys.modules:
        return openblas_active()
    dl = _libdl()
    if dl is None:
        return False
    found = _global_blas(dl)
    return bool(found) and _is_openblas(dl, found)


def reexec_with_openblas(argv: Sequence[str] | None = None) -> None:
    """Re-execute this process once with the system OpenBLAS preloaded (Linux).

    For the console command: call it first thing, ideally before ``mlx`` is imported
    (after works too, it only wastes the import). It replaces the process with
    ``[sys.executable, *argv]`` whose environment has the OpenBLAS library prepended to
    ``LD_PRELOAD`` (an existing value is kept after it), ``OPENBLAS_NUM_THREADS=1``
    unless already set, and ``MLX_STREAM_REEXEC=1``, so that MLX's matmuls use OpenBLAS
    (about 20x faster in float32 than the wheel's reference BLAS). It does nothing (and
    returns) when:

    - not on Linux (macOS: Accelerate), or no system OpenBLAS (:func:`openblas_path`);
      the CLI then prints :func:`blas_hint` instead;
    - MLX is already on OpenBLAS, or would be when loaded (OpenBLAS already in the
      global scope, e.g. preloaded by the user);
    - ``MLX_STREAM_REEXEC`` is set: this process is the re-executed one (so it runs once
      even if the preload did not take);
    - ``MLX_STREAM_NO_REEXEC`` is set to anything but ``""``/``0``: the user's opt-out;
    - the command line is unknown (empty ``sys.orig_argv``: embedded interpreter).

    Args:
        argv: the arguments after the interpreter. Default ``sys.orig_argv[1:]``, the
            exact original command line, interpreter options included, which re-runs a
            console script (``<venv>/bin/mlx-stream args``), ``python -m mlx_stream.cli
            args`` and ``python cli.py args`` alike.

    Errors: none raised; if ``exec`` itself fails (``OSError``) the process just goes on
    with the slow BLAS. Buffered stdout/stderr are flushed before the ``exec``.
    """
    if not sys.platform.startswith("linux"):
        return
    if os.environ.get(NO_REEXEC_ENV, "") not in ("", "0") or os.environ.get(REEXEC_ENV):
        return
    lib = openblas_path()
    if lib is None or not sys.executable:
        return
    if argv is None:
        orig = getattr(sys, "orig_argv", None)
        if not orig:
            return
        argv = orig[1:]
    if _openblas_bound_or_first():
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env[REEXEC_ENV] = "1"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    try:
        os.execve(sys.executable, [sys.executable, *argv], env)
    except OSError:
        return
