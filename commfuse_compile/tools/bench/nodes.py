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

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

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
        environ = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": RANK_DEVICE}
        launched = [
            subprocess.Popen(
                torchrun_command(net, node, nodes, ranks_per_node, script),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=environ,
                start_new_session=True,  # its ranks in its process group, ended together
            )
            for node in range(nodes)
        ]
        deadline = time.monotonic() + timeout_s
        return [_finish(proc, deadline, timeout_s) for proc in launched]


def _finish(proc: subprocess.Popen[str], deadline: float, timeout_s: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, out + f"\n(ended after {timeout_s:.0f} s)"
