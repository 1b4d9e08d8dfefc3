"""Shared fixtures: gloo rank pools, started once per world size for the whole session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from commfuse_compile.tools.ranks import RankPool

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], RankPool]]:
    """``ranks(n)``: a pool of n gloo ranks on loopback (kept for the session)."""
    pools: dict[int, RankPool] = {}

    def get(n: int) -> RankPool:
        if n not in pools:
            pools[n] = RankPool(n, timeout_s=300)
        return pools[n]

    yield get
    for pool in pools.values():
        pool.close()
