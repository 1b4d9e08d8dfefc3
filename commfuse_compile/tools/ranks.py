"""Local ranks: n processes in one gloo group, started once and fed many jobs.

Used by ``commfuse demo`` and by the tests: starting processes and a process group per
example is far too slow for property tests, so a ``RankPool`` keeps its ranks and runs
``fn(rank, world_size, *args)`` on all of them for each job.
"""

from __future__ import annotations

import abc
import contextlib
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch.multiprocessing as mp

R = TypeVar("R", bound="Ranks")


class RankError(RuntimeError):
    """A job failed or timed out on some rank."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def join_gloo(
    rank: int, world_size: int, init_method: str, timeout_s: float, device: str | None = None
) -> None:
    """This process as ``rank`` of a gloo group: one torch thread, sockets on ``device``
    (default: loopback, unless GLOO_SOCKET_IFNAME says otherwise)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device is None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = device
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def serve(rank: int, world_size: int, conn: Any) -> None:
    """Answer ``(fn, args)`` jobs with ``fn(rank, world_size, *args)`` (or the traceback)
    until ``None`` comes or the parent is gone; then leave the group."""
    import torch.distributed as dist

    try:
        while True:
            try:
                job = conn.recv()
            except EOFError:  # the parent is gone
                break
            if job is None:
                break
            fn, args = job
            try:
                conn.send(("ok", fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - reported to the parent
                conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, port: int, conn: Any, timeout_s: float) -> None:
    join_gloo(rank, world_size, f"tcp://127.0.0.1:{port}", timeout_s)
    serve(rank, world_size, conn)


class Ranks(abc.ABC):
    """Rank processes that ``serve`` jobs over connections; subclasses start them."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self._conns: list[Any] = []
        self._procs: list[Any] = []

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; results in rank order."""
        for conn in self._conns:
            conn.send((fn, args))
        deadline = time.monotonic() + self.timeout_s
        results: list[Any] = [None] * self.world_size
        errors = []
        for rank, conn in enumerate(self._conns):
            while not conn.poll(1.0):
                if not self._alive(rank):
                    self._fail(rank, "exited")
                if time.monotonic() > deadline:
                    self._fail(rank, f"did not answer within {self.timeout_s:.0f}s")
            try:
                status, value = conn.recv()
            except EOFError:
                self._fail(rank, "exited")
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RankError("\n".join(errors))
        return results

    def close(self, force: bool = False) -> None:
        for conn in self._conns:
            if not force:
                with contextlib.suppress(OSError):  # a dead rank's connection is closed
                    conn.send(None)
            conn.close()
        for proc in self._procs:
            self._stop(proc, wait_s=0.1 if force else 30)
        self._procs.clear()
        self._conns.clear()

    def _fail(self, rank: int, what: str) -> NoReturn:
        detail = self._detail(rank)
        self.close(force=True)
        raise RankError(f"rank {rank} {what}{detail}")

    @abc.abstractmethod
    def _alive(self, rank: int) -> bool:
        """Is ``rank``'s process still running?"""

    @abc.abstractmethod
    def _stop(self, proc: Any, wait_s: float) -> None:
        """End ``proc``: let it exit within ``wait_s``, then kill it."""

    def _detail(self, rank: int) -> str:
        """What to add to a failure's message (a log, where there is one)."""
        return ""

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


class RankPool(Ranks):
    """``world_size`` gloo ranks on loopback, alive until ``close``. ``timeout_s`` bounds
    one job; ``group_timeout_s`` (default: the same) is the process group's, after which
    a transfer that waits for a stalled peer raises (a deadlock fails fast and named)."""

    def __init__(
        self, world_size: int, timeout_s: float = 300.0, group_timeout_s: float | None = None
    ) -> None:
        super().__init__(world_size, timeout_s)
        group_timeout = timeout_s if group_timeout_s is None else group_timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, child, group_timeout),
                daemon=True,
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def _alive(self, rank: int) -> bool:
        return bool(self._procs[rank].is_alive())

    def _stop(self, proc: Any, wait_s: float) -> None:
        proc.join(timeout=wait_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
