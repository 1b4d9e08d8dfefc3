"""Jobs of several nodes on one machine: a network namespace per node holding the node's
ranks, launched by torchrun's own multi-node launch (c10d rendezvous), one torchrun per
node, as on a cluster.

The namespaces and links are ``netns.ThrottledNetwork``'s ``veth`` topology with a
"rank" per node: each node has its own address on its NIC (a veth to a bridge, behind a
token bucket); the ranks of a node talk over that address (inside the kernel, at memory
speed), the ranks of different nodes through the two NICs. Two things the launch needs
that torchrun's usual command line does not say:

* in a fresh namespace the host name resolves to 127.0.0.1, so c10d's rendezvous cannot
  tell that node 0 is the endpoint's host and every node waits for a store nobody
  serves: node 0 says ``--rdzv-conf is_host=1``, and every node ``--local-addr`` (the
  address its peers reach it at);
* gloo binds to the address of the interface ``GLOO_SOCKET_IFNAME`` names (else of the
  host name: 127.0.0.1, unreachable from the other node).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..ranks import RankError, Ranks, join_gloo, serve
from .netns import RANK_DEVICE, ThrottledNetwork

RDZV_PORT = 29400  # torchrun's default; free in a fresh namespace


def torchrun_command(
    net: ThrottledNetwork, node: int, nodes: int, ranks_per_node: int, script: Sequence[str]
) -> list[str]:
    """Node ``node``'s launch: its torchrun, run inside its namespace."""
    namespace = net.namespace(node)
    assert namespace is not None, "a node is a namespace of the veth topology"
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run"]
    argv += ["--nnodes", str(nodes), "--nproc-per-node", str(ranks_per_node)]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.address(0)}:{RDZV_PORT}"]
    argv += ["--rdzv-id", "commfuse", "--local-addr", net.address(node)]
    if node == 0:
        argv += ["--rdzv-conf", "is_host=1"]
    return [*argv, *script]


def launch(
    net: ThrottledNetwork,
    ranks_per_node: int,
    script: Sequence[str],
    env: Mapping[str, str] | None,
    output: Callable[[int], Any],
) -> list[subprocess.Popen[str]]:
    """Every node's torchrun, started in its namespace; ``output(node)``: where its
    output goes (a file, or ``subprocess.PIPE``)."""
    environ = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": RANK_DEVICE}
    return [
        subprocess.Popen(
            torchrun_command(net, node, net.world_size, ranks_per_node, script),
            stdin=subprocess.DEVNULL,
            stdout=output(node),
            stderr=subprocess.STDOUT,
            text=True,
            env=environ,
            start_new_session=True,  # its ranks in its process group, ended together
        )
        for node in range(net.world_size)
    ]


def run_nodes(
    nodes: int,
    ranks_per_node: int,
    script: Sequence[str],
    rate_bits_per_s: float | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600,
) -> list[tuple[int, str]]:
    """Run ``script`` (a torchrun script and its arguments) on ``nodes`` namespaces of
    ``ranks_per_node`` ranks, each node's NIC limited to ``rate_bits_per_s`` (None:
    unthrottled); returns each node's torchrun (exit code, output). A node still running
    after ``timeout_s`` is ended (its process group), its exit code then -9."""
    with ThrottledNetwork(nodes, "veth") as net:
        net.set_rate(rate_bits_per_s)
        launched = launch(net, ranks_per_node, script, env, lambda node: subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        return [_finish(proc, deadline, timeout_s) for proc in launched]


def _finish(proc: subprocess.Popen[str], deadline: float, timeout_s: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        _end(proc)
        out, _ = proc.communicate()
        return -9, out + f"\n(ended after {timeout_s:.0f} s)"


def _end(proc: subprocess.Popen[str]) -> None:
    """A node's torchrun and its ranks (its process group), killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


class LaunchedRanks(Ranks):
    """The ranks of a multi-node torchrun job on ``network``'s nodes (``ranks_per_node``
    each, numbered node by node as torchrun numbers them), each serving jobs
    (``fn(rank, world_size, *args)``, as ``NamespaceRanks``) over a Unix socket to this
    process: a socket file reaches across network namespaces, so the jobs travel beside
    the job's own network. ``group_timeout_s``: the ranks' process group's timeout."""

    def __init__(
        self,
        network: ThrottledNetwork,
        ranks_per_node: int,
        log_dir: Path,
        timeout_s: float = 600,
        group_timeout_s: float = 120,
    ) -> None:
        super().__init__(network.world_size * ranks_per_node, timeout_s)
        self.ranks_per_node = ranks_per_node
        log_dir.mkdir(parents=True, exist_ok=True)
        self.logs = [log_dir / f"node{node}.log" for node in range(network.world_size)]
        where = tempfile.mkdtemp(prefix="cfnodes")  # short: a socket path has 107 bytes
        path = os.path.join(where, "jobs.sock")
        listener = socket.socket(socket.AF_UNIX)
        try:
            listener.bind(path)
            listener.listen(self.world_size)
            script = ["-m", __name__, "--socket", path, "--timeout", str(group_timeout_s)]
            env = {"OMP_NUM_THREADS": "1"}
            self.commands = [  # each node's, for the record
                " ".join(
                    torchrun_command(network, node, network.world_size, ranks_per_node, script)
                )
                for node in range(network.world_size)
            ]
            with contextlib.ExitStack() as logs:  # each child keeps its own descriptor
                opened = [logs.enter_context(open(log, "w")) for log in self.logs]
                self._procs = launch(network, ranks_per_node, script, env, opened.__getitem__)
            self._conns = self._accept(listener, time.monotonic() + timeout_s)
        except BaseException:
            self.close(force=True)
            raise
        finally:
            listener.close()
            shutil.rmtree(where, ignore_errors=True)

    def _accept(self, listener: socket.socket, deadline: float) -> list[Any]:
        """Each rank's connection, in rank order (each says its rank first)."""
        by_rank: dict[int, Any] = {}
        listener.settimeout(1.0)
        while len(by_rank) < self.world_size:
            for node, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    raise RankError(f"node {node}'s torchrun exited{self._tail(node)}")
            if time.monotonic() > deadline:
                raise RankError(f"ranks {sorted(by_rank)} of {self.world_size} connected")
            with contextlib.suppress(TimeoutError):
                sock, _ = listener.accept()
                conn = Connection(sock.detach())
                by_rank[conn.recv()] = conn
        return [by_rank[rank] for rank in range(self.world_size)]

    def _tail(self, node: int, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            text = self.logs[node].read_text(errors="replace").splitlines()[-lines:]
            return "; its log ends:\n" + "\n".join(text)
        return ""

    def _alive(self, rank: int) -> bool:
        return self._procs[rank // self.ranks_per_node].poll() is None

    def _stop(self, proc: Any, wait_s: float) -> None:
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            _end(proc)
            proc.wait()

    def _detail(self, rank: int) -> str:
        return self._tail(rank // self.ranks_per_node)


def describe(nodes: int, ranks_per_node: int) -> str:
    """The network of ``launched_ranks``, in words."""
    return (
        f"{nodes} nodes, each a network namespace of {ranks_per_node} ranks talking over "
        "the node's own address (unthrottled); each node's NIC a veth link to a bridge, "
        "a tbf on its sending side (full duplex, shared by the node's ranks); one torchrun "
        "per node, c10d rendezvous"
    )


@contextlib.contextmanager
def launched_ranks(
    nodes: int, ranks_per_node: int, log_dir: Path
) -> Iterator[tuple[ThrottledNetwork, LaunchedRanks, str]]:
    """``nodes`` namespaces and their launched ranks (as ``netns.throttled_ranks``
    gives a namespace per rank), both removed on exit."""
    with (
        ThrottledNetwork(nodes, "veth") as network,
        LaunchedRanks(network, ranks_per_node, log_dir) as ranks,
    ):
        yield network, ranks, describe(nodes, ranks_per_node)


def _rank(socket_path: str, timeout_s: float) -> None:
    """One rank of ``LaunchedRanks``' job (torchrun's environment): say its rank to the
    parent, join the job's gloo group (torchrun's rendezvous, over the node's NIC), then
    serve jobs."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(socket_path)
    conn = Connection(sock.detach())
    conn.send(rank)
    join_gloo(rank, world_size, "env://", timeout_s, RANK_DEVICE)
    serve(rank, world_size, conn)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a rank of LaunchedRanks (started by torchrun)")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    arguments = parser.parse_args()
    _rank(arguments.socket, arguments.timeout)
