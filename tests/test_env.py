"""Which BLAS MLX really calls, and the re-exec onto OpenBLAS, in real subprocesses.

``import mlx_stream.env`` does not import MLX, so the re-exec scripts call it before MLX
loads, as the console command does; one test imports MLX first (the re-exec then asks
MLX itself). The ground truth for "which library does MLX call" is read independently of env.py's
method: the address the dynamic linker wrote into ``libmlx.so``'s GOT slot for
``cblas_sgemm``, named by ``dladdr``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS only")

LOAD_ENV = """
import sys
from mlx_stream import env
assert "mlx.core" not in sys.modules, "importing mlx_stream.env must not import MLX"
"""

# The file that the dynamic linker bound libmlx.so's cblas_sgemm to: the GOT slot's
# contents (Python dlopens with RTLD_NOW, so the slot is filled at load time).
GOT_TRUTH = r"""
import ctypes, os, struct
import mlx.core

def got_blas(symbol=b"cblas_sgemm"):
    lib = os.path.join(os.path.dirname(mlx.core.__file__), "lib", "libmlx.so")
    data = open(lib, "rb").read()
    assert data[:4] == b"\x7fELF" and data[4] == 2, "64-bit ELF expected"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    dynsym = next(i for i, s in enumerate(secs) if s[1] == 11)          # SHT_DYNSYM
    strtab = secs[secs[dynsym][6]]
    def name(off):
        start = strtab[4] + off
        return data[start:data.index(b"\0", start)]
    index = next(i for i in range(secs[dynsym][5] // 24)
                 if name(struct.unpack_from("<I", data, secs[dynsym][4] + 24 * i)[0]) == symbol)
    slots = [struct.unpack_from("<QQ", data, s[4] + 24 * k)[0]
             for s in secs if s[1] == 4 and s[6] == dynsym               # SHT_RELA
             for k in range(s[5] // 24)
             if struct.unpack_from("<QQ", data, s[4] + 24 * k)[1] >> 32 == index]
    assert slots, "no relocation for " + symbol.decode()
    real = os.path.realpath(lib)
    base = min(int(line.split("-")[0], 16) for line in open("/proc/self/maps")
               if line.split()[-1] == real)
    class Info(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
    info = Info()
    dladdr = ctypes.CDLL(None).dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(Info)]
    addr = ctypes.c_void_p.from_address(base + slots[0]).value
    assert dladdr(addr, ctypes.byref(info)), "GOT slot points nowhere"
    return info.fname.decode()
"""


def _env(**changes):
    e = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "MLX_STREAM_REEXEC", "MLX_STREAM_NO_REEXEC")
    }
    e.update({k: v for k, v in changes.items() if v is not None})
    return e


def _run(args, env, cwd=None):
    p = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _probe(env):
    script = (
        LOAD_ENV
        + GOT_TRUTH
        + textwrap.dedent("""
        import json
        maps_has_openblas = "openblas" in open("/proc/self/maps").read()
        print(json.dumps({"active": env.openblas_active(),
                          "blas": env.mlx_blas(), "got": got_blas(), "hint": env.blas_hint(),
                          "maps_has_openblas": maps_has_openblas}))
    """)
    )
    # numpy first: its bundled OpenBLAS is mapped before MLX loads
    return json.loads(
        _run([sys.executable, "-c", "import numpy; numpy.ones(3) @ numpy.ones(3)\n" + script], env)
        .strip()
        .splitlines()[-1]
    )


def _openblas():
    from mlx_stream.env import openblas_path

    path = openblas_path()
    if path is None:
        pytest.skip("no system OpenBLAS (apt-get install libopenblas0-pthread)")
    return path


def test_preloaded_openblas_is_what_mlx_calls():
    lib = _openblas()
    r = _probe(_env(LD_PRELOAD=lib, OPENBLAS_NUM_THREADS="1"))
    assert r["active"] is True
    assert os.path.samefile(r["blas"], lib), r
    assert os.path.samefile(r["got"], lib), r  # the linker really bound it there
    assert r["hint"] is None


def test_numpy_openblas_does_not_fool_it():
    r = _probe(_env())
    assert r["maps_has_openblas"], "numpy's bundled OpenBLAS should be mapped (the old check's trap)"
    assert r["active"] is False
    assert "openblas" not in os.path.basename(r["blas"]).lower(), r
    assert os.path.samefile(r["blas"], r["got"]), r  # the wheel's reference libblas
    assert r["hint"].startswith("note: slow reference BLAS in use")
    assert "OPENBLAS_NUM_THREADS=1" in r["hint"] and "LD_PRELOAD=" in r["hint"]


REEXEC_SCRIPT = textwrap.dedent("""
    import os, sys
    print("run", os.environ.get("MLX_STREAM_REEXEC"), flush=True)
    env.reexec_with_openblas()
    print("end", env.openblas_active(), os.environ.get("MLX_STREAM_REEXEC"),
          os.environ.get("LD_PRELOAD"), os.environ.get("OPENBLAS_NUM_THREADS"),
          __name__, sys.argv[1:], flush=True)
""")


@pytest.mark.parametrize("how", ["script", "-m", "console"])
def test_reexec_runs_once_onto_openblas(tmp_path, how):
    lib = _openblas()
    (tmp_path / "probe_mod.py").write_text(LOAD_ENV + REEXEC_SCRIPT)
    if how == "script":
        args, env = [sys.executable, str(tmp_path / "probe_mod.py"), "a", "--b"], _env()
    elif how == "-m":
        args, env = [sys.executable, "-m", "probe_mod", "a", "--b"], _env()
    else:  # a console script: a shebang file run directly; an existing LD_PRELOAD and thread count stay
        script = tmp_path / "probe-cmd"
        script.write_text(f"#!{sys.executable}\n" + LOAD_ENV + REEXEC_SCRIPT)
        script.chmod(0o755)
        libm = next(
            (
                p
                for p in (
                    "/lib/x86_64-linux-gnu/libm.so.6",
                    "/lib/aarch64-linux-gnu/libm.so.6",
                    "/lib64/libm.so.6",
                )
                if os.path.exists(p)
            ),
            None,
        )
        args, env = [str(script), "a", "--b"], _env(LD_PRELOAD=libm, OPENBLAS_NUM_THREADS="2")
    lines = _run(args, env, cwd=tmp_path).splitlines()
    assert lines[:2] == ["run None", "run 1"], lines  # re-executed exactly once
    assert len(lines) == 3 and lines[2].startswith("end True 1 "), lines
    if how == "console":
        preload = f"{lib}:{env['LD_PRELOAD']}" if "LD_PRELOAD" in env else lib
        assert f" {preload} 2 " in lines[2], lines
    else:
        assert f" {lib} 1 " in lines[2], lines
    assert lines[2].endswith("__main__ ['a', '--b']"), lines


@pytest.mark.parametrize("var", ["MLX_STREAM_NO_REEXEC", "MLX_STREAM_REEXEC"])
def test_no_reexec_when_opted_out_or_already_done(tmp_path, var):
    _openblas()
    (tmp_path / "probe_mod.py").write_text(LOAD_ENV + REEXEC_SCRIPT)
    lines = _run([sys.executable, str(tmp_path / "probe_mod.py")], _env(**{var: "1"})).splitlines()
    assert len(lines) == 2 and lines[0].startswith("run ") and lines[1].startswith("end False "), lines


def test_no_reexec_when_openblas_already_preloaded(tmp_path):
    lib = _openblas()
    (tmp_path / "probe_mod.py").write_text(LOAD_ENV + REEXEC_SCRIPT)
    lines = _run([sys.executable, str(tmp_path / "probe_mod.py")], _env(LD_PRELOAD=lib)).splitlines()
    assert lines[0] == "run None" and len(lines) == 2 and lines[1].startswith(f"end True None {lib} "), lines


def test_reexec_after_mlx_was_imported(tmp_path):
    """MLX already loaded (on the reference BLAS): the decision comes from
    openblas_active() itself, and the re-exec still lands on OpenBLAS."""
    lib = _openblas()
    script = tmp_path / "mlx_first.py"
    script.write_text("import mlx.core\nfrom mlx_stream import env\n" + REEXEC_SCRIPT)
    lines = _run([sys.executable, str(script)], _env()).splitlines()
    assert lines[:2] == ["run None", "run 1"] and len(lines) == 3, lines
    assert lines[2].startswith(f"end True 1 {lib} 1 "), lines
