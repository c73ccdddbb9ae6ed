"""The ranks of one job on ``mlx.distributed`` (Apple's MLX distributed layer: started by
``mlx.launch`` with the ring or MPI backend, on one machine or across a hostfile's machines).

A process that was not launched so is a job of one rank, and every collective here is then
free. Collectives carry arrays (``all_sum``) and small JSON objects (byte arrays gathered
with ``all_gather``); :meth:`Ranks.share_folder` copies a finished folder from the rank
that wrote it to the machines that lack it, so ranks need no shared file system.

:func:`launch_local` starts ``n`` ranks on this machine (the ring backend on 127.0.0.1,
free ports), as ``mlx.launch -n N`` does; ``--workers N`` of the commands is that.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

# environment variables that mark a process started by a distributed launcher
_LAUNCHED = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_CHUNK = 1 << 26  # bytes per collective when a folder is copied between machines

_WATCHDOG = r"""
import os, signal, sys, time
pid, timeout, msg = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
import select
r, _, _ = select.select([sys.stdin], [], [], timeout)
if not r:  # the parent neither connected nor exited in time
    sys.stderr.write(msg + "\n"); sys.stderr.flush()
    try:
        os.kill(pid, signal.SIGTERM); time.sleep(2); os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


@dataclass
class Ranks:
    """The processes of one job: ``rank`` in ``0..size-1``; ``local_size`` of them on
    this machine (they share its cores). ``group`` is None for a job of one rank."""

    rank: int = 0
    size: int = 1
    local_size: int = 1
    group: object = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes checkpoints, heads and reports."""
        return self.rank == 0

    def threads(self) -> int:
        """This rank's share of the machine's cores (at least 1)."""
        return max((os.cpu_count() or 1) // self.local_size, 1)

    def sum(self, x: mx.array) -> mx.array:
        """``x`` summed over the ranks (``mx.distributed.all_sum``); ``x`` itself for one rank."""
        return x if self.size == 1 else mx.distributed.all_sum(x, group=self.group)

    def barrier(self) -> None:
        """Return when every rank has reached this call."""
        if self.size > 1:
            mx.eval(self.sum(mx.zeros((1,), dtype=mx.int32)))

    def broadcast(self, x: mx.array, root: int = 0) -> mx.array:
        """Rank ``root``'s ``x`` on every rank (same shape and dtype on each; a sum in which
        the other ranks add zeros, so it is exact)."""
        if self.size == 1:
            return x
        return self.sum(x if self.rank == root else mx.zeros_like(x))

    def broadcast_tree(self, tree, root: int = 0):
        """Rank ``root``'s tree of arrays (parameters, optimizer state) on every rank, as
        a tree built from rank ``root``'s flat keys (``mlx.utils.tree_unflatten``): the
        other ranks' trees may be missing entries or hold them in another order."""
        from mlx.utils import tree_flatten, tree_unflatten

        if self.size == 1:
            return tree
        flat = dict(tree_flatten(tree)) if self.rank == root else {}
        spec = self.broadcast_object(
            [(k, list(v.shape), str(v.dtype).split(".")[-1]) for k, v in flat.items()], root=root
        )
        return tree_unflatten(
            [
                (k, self.broadcast(flat[k] if self.rank == root else mx.zeros(shape, getattr(mx, dt)), root))
                for k, shape, dt in spec
            ]
        )

    def gather(self, obj) -> list:
        """Each rank's JSON-serialisable ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        data = np.frombuffer(json.dumps(obj).encode("utf-8"), dtype=np.uint8)
        lengths = np.zeros(self.size, dtype=np.int32)
        lengths[self.rank] = len(data)
        lengths = np.array(self.sum(mx.array(lengths)))
        padded = np.zeros(int(lengths.max()), dtype=np.uint8)
        padded[: len(data)] = data
        rows = np.array(mx.distributed.all_gather(mx.array(padded), group=self.group))
        rows = rows.reshape(self.size, -1)
        return [json.loads(bytes(rows[r, : lengths[r]]).decode("utf-8")) for r in range(self.size)]

    def map(self, fn: Callable[[list], list], items: Sequence) -> list:
        """``fn`` over ``items`` split between the ranks (:func:`shard`: item i on rank
        i mod size), every rank getting all the results in item order. ``fn`` maps a
        list of items to one JSON-serialisable result per item."""
        parts = self.gather(fn(shard(items, self)))
        return [parts[i % self.size][i // self.size] for i in range(len(items))]

    def broadcast_object(self, obj, root: int = 0):
        """Rank ``root``'s JSON-serialisable ``obj`` on every rank."""
        return self.gather(obj if self.rank == root else None)[root]

    def share_folder(self, folder: Path, owner: int, want: bool) -> None:
        """Copy the finished folder ``folder`` from rank ``owner`` to every rank that passes
        ``want=True`` (each writes it beside itself and renames it in when whole).

        Every rank must call this with the same ``owner``; a no-op when nobody wants it.
        The folder's files travel in 64 MiB collectives (no shared file system needed).
        """
        if self.size == 1 or not any(self.gather(bool(want))):
            return
        from .files import staged_folder

        folder = Path(folder)
        names = sorted(p.name for p in folder.iterdir() if p.is_file()) if self.rank == owner else None
        sizes = [(n, (folder / n).stat().st_size) for n in names] if names is not None else None
        sizes = self.broadcast_object(sizes, root=owner)
        with contextlib.ExitStack() as stack:  # the staged copy is renamed in only when whole
            tmp = stack.enter_context(staged_folder(folder, replace=True)) if want else None
            for name, size in sizes:
                with contextlib.ExitStack() as files:
                    src = files.enter_context(open(folder / name, "rb")) if self.rank == owner else None
                    dst = files.enter_context(open(tmp / name, "wb")) if tmp is not None else None
                    for start in range(0, size, _CHUNK):
                        n = min(_CHUNK, size - start)
                        buf = np.zeros(n, dtype=np.uint8)
                        if src is not None:
                            buf[:] = np.frombuffer(src.read(n), dtype=np.uint8)
                        got = np.array(self.broadcast(mx.array(buf), root=owner))
                        if dst is not None:
                            dst.write(got.tobytes())


def launched() -> bool:
    """Whether this process was started by a distributed launcher (``mlx.launch``, mpirun)."""
    return any(v in os.environ for v in _LAUNCHED)


def connect(timeout_s: float = 120.0) -> Ranks:
    """The job this process belongs to: ``mx.distributed.init()`` when a launcher started
    it, otherwise a job of one rank.

    ``mx.distributed.init`` waits for every rank to connect and cannot be interrupted from
    Python, so a watchdog process ends this one after ``timeout_s`` seconds with a message
    that names the hosts to check (a rank that never starts, a wrong address or port, a
    firewall).

    Raises:
        ValueError: ``timeout_s`` is not positive.
    """
    if not timeout_s > 0:
        raise ValueError(f"connect timeout must be > 0 seconds, got {timeout_s!r}")
    if not launched():
        return Ranks()
    where = os.environ.get("MLX_HOSTFILE", "")
    hosts = ""
    if where and Path(where).is_file():
        hosts = Path(where).read_text().strip()
    msg = (
        f"error: rank {os.environ.get('MLX_RANK', '?')} could not connect to the other ranks within "
        f"{timeout_s:.0f} s (hosts {hosts or 'from the launcher'}): check that every rank was started "
        "(the same command on each machine, by mlx.launch), that the addresses and ports are this "
        "network's and not blocked by a firewall; --connect-timeout waits longer"
    )
    dog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(timeout_s), msg],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    try:
        group = mx.distributed.init(strict=True)
    finally:
        dog.stdin.close()  # the watchdog's select returns: it exits without acting
        dog.wait()
    ranks = Ranks(rank=group.rank(), size=group.size(), group=group)
    hosts = ranks.gather(socket.gethostname())
    ranks.local_size = hosts.count(hosts[ranks.rank])
    return ranks


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _rank_entry(rank: int, hostfile: str, target: Callable, args: tuple) -> None:
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = hostfile
    target(*args)


def launch_local(n: int, target: Callable, args: tuple = (), poll_s: float = 0.2) -> None:
    """Run ``target(*args)`` as ``n`` ranks of one job on this machine (the ring backend
    on 127.0.0.1, each rank a spawned process; what ``mlx.launch -n N`` starts), and wait.
    When one rank fails the others are ended, as ``mlx.launch`` does.

    ``target`` must be importable (a module-level function); it calls :func:`connect`.

    Raises:
        RuntimeError: a rank failed (its traceback is printed by that process); the
            message names which.
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"the number of ranks must be >= 1, got {n}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="mlx-stream-ranks-") as tmp:
        hostfile = Path(tmp) / f"hosts-{uuid.uuid4().hex[:8]}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        procs = [ctx.Process(target=_rank_entry, args=(r, str(hostfile), target, args)) for r in range(n)]
        for p in procs:
            p.start()
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                time.sleep(poll_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        codes = ", ".join(f"rank {r}: exit {procs[r].exitcode}" for r in failed)
        raise RuntimeError(f"{len(failed)} of {n} ranks failed or were ended ({codes})")


def shard(items: Sequence, ranks: Ranks) -> list:
    """This rank's items: every ``size``-th from ``rank`` on (the split of independent
    work, prompts or sequences, over the ranks)."""
    return list(items[ranks.rank :: ranks.size])
