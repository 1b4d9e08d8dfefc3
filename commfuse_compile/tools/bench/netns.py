"""Throttled links for ``commfuse bench``: gloo ranks in network namespaces behind tbf qdiscs.

Over plain loopback, gloo's transfers cost CPU rather than wall time, so there is nothing
for a matmul to hide. Behind a token-bucket filter (``tc qdisc ... tbf``) a message takes
``bytes / rate`` of wall time while the CPU is free, as on a real link. Topologies:

* ``veth`` (preferred): one namespace per rank, each with a veth pair to a bridge in a
  switch namespace, and a tbf on the rank's end: every rank has its own link whose rate
  limits what it sends, full duplex, like a NIC on a switch (or a ring of links for n=2).
* ``lo``: one namespace whose loopback is behind one tbf: every message of every rank
  shares one rate, both directions included. Used when veth pairs cannot be created.
* ``none``: plain loopback, unthrottled (not root, or namespaces unavailable).

Everything created is named ``cfbench<pid>-...`` and removed on exit, on failure and on
Ctrl-C / SIGTERM / SIGHUP (a context manager plus signal handlers); namespaces left by a
process that no longer exists (SIGKILL) are removed when the next network is created.
Ranks run as ``ip netns exec NAME python -m commfuse_compile.tools.bench.netns ...``
(:class:`NamespaceRanks`), fed jobs over a socket pair like :class:`~..ranks.RankPool`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Any

from ..ranks import Ranks, free_port, join_gloo, serve

PREFIX = "cfbench"
TOPOLOGIES = ("veth", "lo", "none")
SUBNET = "10.213.0"  # rank r is SUBNET.(r+1), inside the benchmark's own namespaces only
RANK_DEVICE = "link0"  # the rank's end of its veth pair (in the rank's namespace)
MTU = "9000"  # jumbo frames, as on cluster networks: fewer packets for the CPU to handle
MASTER_PORT = 29500  # free in a fresh namespace
QUEUE_LATENCY = "100ms"  # tbf queue length in time: long enough that TCP sees no drops
# The token bucket's depth: 1 ms of traffic at every rate, so that what a message gains
# from a full bucket after an idle spell is the same time at every rate (the profile the
# cost model gets is measured at two rates and taken to others, ``link.LinkProfiles``).
# A floor of 128 KiB (one GSO packet unsplit) made it 4 ms at 250 Mbit/s: an idle link's
# 256 KiB message took 4.6 ms there, 7.8 with 1 ms (the wire's 8.4), and the dropless
# MoE's round trip at 247 Mbit/s ran 1.4x faster than its model. tbf splits a GSO packet
# larger than the bucket; the floor keeps two jumbo frames.
BURST_S = 1e-3
MIN_BURST_BYTES = 2 * (int(MTU) + 256)
# Each namespace's TCP receive buffer to start with (``net.ipv4.tcp_rmem``, per namespace;
# min, default, max), as cluster hosts are tuned. With the kernel's 128 KiB default, a
# message larger than that stops while its receiver computes: the rest waits for gloo's
# thread to read, and the compute thread holds the core. Measured here at 1 Gbit/s, a
# 256 KiB exchange under a 2.5 ms matmul: 0.9-1.2 ms left to wait after it, 0.015 ms
# with 4 MiB; a NIC moves the bytes whatever its host computes.
TCP_RECEIVE_BUFFER = "4096 4194304 33554432"


def burst_bytes(bits_per_s: float) -> int:
    """The tbf's bucket at ``bits_per_s``: ``BURST_S`` of traffic."""
    return max(MIN_BURST_BYTES, int(bits_per_s / 8 * BURST_S))


class NetworkError(RuntimeError):
    """A namespace, link or qdisc could not be created or changed."""


def _run(argv: list[str], namespace: str | None = None) -> str:
    if namespace is not None:
        argv = ["ip", "netns", "exec", namespace, *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def can_throttle() -> str | None:
    """None when this process can build throttled links, else why not."""
    if os.geteuid() != 0:
        return "not root: network namespaces and qdiscs need root"
    missing = [tool for tool in ("ip", "tc", "sysctl") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2, procps)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete our namespaces whose creating process is gone; returns their names."""
    removed = []
    for line in _run(["ip", "netns", "list"]).splitlines():
        name = line.split()[0] if line.strip() else ""
        found = re.fullmatch(rf"{PREFIX}(\d+)-\w+", name)
        if found and not _pid_alive(int(found.group(1))):
            with contextlib.suppress(NetworkError):
                _run(["ip", "netns", "delete", name])
                removed.append(name)
    return removed


class ThrottledNetwork:
    """``world_size`` ranks' network, as a context manager; ``set_rate`` sets every link."""

    def __init__(self, world_size: int, topology: str = "veth") -> None:
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
        self.world_size, self.topology = world_size, topology
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.namespaces: list[str] = []  # created so far, removed by close()
        self.rate_bits_per_s: float | None = None  # None: unthrottled
        self._previous_handlers: dict[int, Any] = {}
        self._host_port: int | None = None

    # -- what the ranks see

    def namespace(self, rank: int) -> str | None:
        if self.topology == "veth":
            return f"{self.prefix}-r{rank}"
        return f"{self.prefix}-lo" if self.topology == "lo" else None

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}" if self.topology == "veth" else "127.0.0.1"

    def device(self, rank: int) -> str:
        return RANK_DEVICE if self.topology == "veth" else "lo"

    @property
    def master_port(self) -> int:
        """Rank 0's rendezvous port: fixed in our namespaces, any free one on the host."""
        if self.topology != "none":
            return MASTER_PORT
        if self._host_port is None:
            self._host_port = free_port()
        return self._host_port

    def describe(self) -> str:
        return {
            "veth": f"{self.world_size} namespaces, one veth link per rank to a bridge, "
            "tbf on each rank's sending side (full duplex, a link per rank)",
            "lo": "one namespace, tbf on its loopback (every message of every rank shares "
            "one rate)",
            "none": "plain loopback, UNTHROTTLED",
        }[self.topology]

    # -- lifecycle

    def __enter__(self) -> ThrottledNetwork:
        if self.topology == "none":
            return self
        self._catch_signals()
        try:
            remove_stale_namespaces()
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace we created (with it go its links and qdiscs)."""
        for name in reversed(self.namespaces):
            with contextlib.suppress(NetworkError, subprocess.TimeoutExpired):
                _run(["ip", "netns", "delete", name])
        self.namespaces.clear()
        self._restore_signals()

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _run(["ip", "link", "set", "lo", "up"], name)
        _run(["sysctl", "-q", "-w", f"net.ipv4.tcp_rmem={TCP_RECEIVE_BUFFER}"], name)

    def _create(self) -> None:
        if self.topology == "lo":
            self._add_namespace(f"{self.prefix}-lo")
            return
        switch = f"{self.prefix}-sw"
        self._add_namespace(switch)
        _run(["ip", "link", "add", "br0", "type", "bridge"], switch)
        _run(["ip", "link", "set", "br0", "up"], switch)
        for rank in range(self.world_size):
            ns = self.namespace(rank)
            assert ns is not None
            self._add_namespace(ns)
            port = f"port{rank}"
            _run(
                ["ip", "link", "add", RANK_DEVICE, "netns", ns, "type", "veth"]
                + ["peer", "name", port, "netns", switch]
            )
            _run(["ip", "link", "set", port, "mtu", MTU, "master", "br0", "up"], switch)
            _run(["ip", "addr", "add", f"{self.address(rank)}/24", "dev", RANK_DEVICE], ns)
            _run(["ip", "link", "set", RANK_DEVICE, "mtu", MTU, "up"], ns)

    def _throttled_devices(self) -> list[tuple[str, str]]:
        """(namespace, device) of every qdisc the rate applies to."""
        if self.topology == "lo":
            return [(f"{self.prefix}-lo", "lo")]
        return [(f"{self.prefix}-r{r}", RANK_DEVICE) for r in range(self.world_size)]

    def set_rate(self, bits_per_s: float | None) -> None:
        """Every link to ``bits_per_s`` (a tbf), or unthrottled with None."""
        if self.topology == "none":
            return
        for ns, dev in self._throttled_devices():
            if bits_per_s is None:
                with contextlib.suppress(NetworkError):  # no qdisc yet
                    _run(["tc", "qdisc", "del", "dev", dev, "root"], ns)
                continue
            _run(
                ["tc", "qdisc", "replace", "dev", dev, "root", "tbf"]
                + ["rate", f"{int(bits_per_s)}bit", "burst", str(burst_bytes(bits_per_s))]
                + ["latency", QUEUE_LATENCY],
                ns,
            )
        self.rate_bits_per_s = bits_per_s

    def qdisc_stats(self) -> dict[str, str]:
        """``tc -s qdisc`` of every throttled device (drops, overlimits), for the record."""
        if self.topology == "none":
            return {}
        return {
            f"{ns}:{dev}": _run(["tc", "-s", "qdisc", "show", "dev", dev], ns).strip()
            for ns, dev in self._throttled_devices()
        }

    # -- signals: turn SIGTERM / SIGHUP into SystemExit so that cleanup runs

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def leave(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, leave)

    def _restore_signals(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()


def open_network(world_size: int, topology: str | None = None) -> tuple[ThrottledNetwork, str]:
    """The best network this process can build, entered, and a line saying what it is.

    ``topology`` None: ``veth``, else ``lo``, else unthrottled (said loudly)."""
    why_not = can_throttle()
    if why_not is not None and topology != "none":
        net = ThrottledNetwork(world_size, "none")
        return net.__enter__(), f"UNTHROTTLED ({why_not}): communication is nearly free"
    errors = []
    for choice in [topology] if topology else ["veth", "lo"]:
        net = ThrottledNetwork(world_size, choice)
        try:
            return net.__enter__(), net.describe()
        except NetworkError as err:
            errors.append(f"{choice}: {err}")
    net = ThrottledNetwork(world_size, "none")
    return net.__enter__(), "UNTHROTTLED (" + "; ".join(errors) + ")"


class NamespaceRanks(Ranks):
    """``world_size`` gloo ranks, each in its namespace of ``network``; ``run`` feeds them
    ``fn(rank, world_size, *args)`` jobs (functions importable by name, pickled)."""

    def __init__(self, network: ThrottledNetwork, log_dir: Path, timeout_s: float = 600) -> None:
        super().__init__(network.world_size, timeout_s)
        self.logs = [log_dir / f"rank{r}.log" for r in range(self.world_size)]
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            for rank in range(self.world_size):
                parent, child = socket.socketpair()
                argv = [sys.executable, "-m", "commfuse_compile.tools.bench.netns"]
                argv += ["--fd", str(child.fileno()), "--rank", str(rank)]
                argv += ["--world-size", str(self.world_size), "--timeout", str(timeout_s)]
                argv += ["--master", f"{network.address(0)}:{network.master_port}"]
                argv += ["--device", network.device(rank)]
                ns = network.namespace(rank)
                if ns is not None:
                    argv = ["ip", "netns", "exec", ns, *argv]
                with open(self.logs[rank], "wb") as log:
                    proc = subprocess.Popen(
                        argv,
                        pass_fds=(child.fileno(),),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,  # Ctrl-C reaches the parent, which stops us
                    )
                child.close()
                self._procs.append(proc)
                self._conns.append(Connection(parent.detach()))
        except BaseException:
            self.close(force=True)
            raise

    def log_tail(self, rank: int, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.logs[rank].read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _alive(self, rank: int) -> bool:
        return self._procs[rank].poll() is None

    def _stop(self, proc: Any, wait_s: float) -> None:
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _detail(self, rank: int) -> str:
        return f"; its log ends:\n{self.log_tail(rank)}"


@contextlib.contextmanager
def throttled_ranks(
    world_size: int, log_dir: Path, topology: str | None = None
) -> Iterator[tuple[ThrottledNetwork, NamespaceRanks, str]]:
    """The network (see :func:`open_network`) and its ranks, both removed on exit."""
    network, description = open_network(world_size, topology)
    try:
        with NamespaceRanks(network, log_dir) as ranks:
            yield network, ranks, description
    finally:
        network.close()


def _worker(args: argparse.Namespace) -> None:
    """One rank: join the gloo group over the namespace's device, then serve jobs."""
    conn = Connection(args.fd)
    join_gloo(args.rank, args.world_size, f"tcp://{args.master}", args.timeout, args.device)
    serve(args.rank, args.world_size, conn)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a benchmark rank (started by NamespaceRanks)")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    _worker(parser.parse_args())
