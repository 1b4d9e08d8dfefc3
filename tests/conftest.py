"""Shared fixtures: gloo rank pools, started once per world size for the whole session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from commfuse_compile.tools.ranks import RankPool

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite runs strict: an unexpected error inside the pass raises instead of declining
# its site (a test that injects one to check the fall-back turns it off for itself).
os.environ["COMMFUSE_STRICT"] = "1"

# The process group's timeout on every pool: a transfer whose peer never comes raises
# this soon, naming its site and step, instead of stalling the suite. The pass's
# compile-time exchange waits half of it for the slowest rank's compile (4 ranks of
# Inductor on 2 cores can finish tens of seconds apart).
GROUP_TIMEOUT_S = 120.0


def rank_pools() -> Iterator[Callable[[int], RankPool]]:
    """``get(n)``: a pool of n gloo ranks on loopback, started at its first use, whose
    process group times out after ``GROUP_TIMEOUT_S``; all closed at the end."""
    pools: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        if n not in pools:
            pools[n] = RankPool(n, timeout_s=900, group_timeout_s=GROUP_TIMEOUT_S)
        return pools[n]

    yield get
    # Each rank is told its parent is done (its connection closed: it leaves the group)
    # and ended a moment later, not waited for through its interpreter's shutdown: with
    # torch loaded that is 1-3 s of CPU a rank, some dozen ranks on 2 cores at the end.
    for pool in pools.values():
        pool.close(force=True)


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], RankPool]]:
    """``ranks(n)``: the session's pool of n ranks (``rank_pools``)."""
    yield from rank_pools()
