"""Local ranks: n processes in one gloo group, started once and fed many jobs.

Used by ``commfuse demo`` and by the tests: starting processes and a process group per
example is far too slow for property tests, so a ``RankPool`` keeps its ranks and runs
``fn(rank, world_size, *args)`` on all of them for each job.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A job failed or timed out on some rank."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, conn: Any, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        while True:
            job = conn.recv()
            if job is None:
                break
            fn, args = job
            try:
                conn.send(("ok", fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - reported to the parent
                conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks on loopback, alive until ``close``."""

    def __init__(self, world_size: int, timeout_s: float = 300.0) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, world_size, port, child, timeout_s), daemon=True
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; results in rank order."""
        for conn in self._conns:
            conn.send((fn, args))
        deadline = time.monotonic() + self.timeout_s
        results: list[Any] = [None] * self.world_size
        errors = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close(force=True)
                raise RankError(f"rank {rank} did not answer within {self.timeout_s:.0f}s")
            status, value = conn.recv()
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RankError("\n".join(errors))
        return results

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if not force and proc.is_alive():
                with contextlib.suppress(OSError):  # a dead rank's pipe is closed
                    conn.send(None)
        for proc in self._procs:
            proc.join(timeout=0 if force else 30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs.clear()
        self._conns.clear()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
