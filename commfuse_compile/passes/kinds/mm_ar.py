"""Matmul -> all-reduce: plain tensor parallelism's row-parallel output (DTensor's
``RowwiseParallel`` with its replicated output, Hugging Face's ``tp_plan="auto"``,
Megatron without sequence parallelism) and the column-parallel input's gradient.

    # before                          # after
    y = wait(all_reduce(x @ w))       blk = mm_rs's ring over the rows of x @ w   # block r, summed
                                      y = wait(all_gather(blk))

An all-reduce is a reduce-scatter then an all-gather. The reduce-scatter half runs as
``mm_rs`` runs it (``kit/reduced``): the product is cut into n blocks of its rows
(the tokens), each block's partial sent on while the next is computed; each rank then
holds its block summed over the group, and one all-gather of those blocks (the
all-reduce's second half, the same bytes) gives every rank the whole sum. Every
all-reduce is a site, so none goes unreported: one whose operand is not a matmul (or a
sum of matmuls) behind views and casts is declined (``ar.not_matmul``).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ...cost.simulator import Work
from ...runtime.groups import Group
from ...schedules import Direction, Schedule
from ..fx.graph import val
from ..kit.all_reduce import AllReduceSite, match_all_reduce
from ..kit.blocks import make_contiguous, view
from ..kit.reduced import flops, reduce_block
from ..kit.rewrite import Rewrite, Taken
from ..kit.ring import replace_collective
from ..kit.site_kind import AtCollective

c10d = torch.ops._c10d_functional


class MmAr(AtCollective[AllReduceSite]):
    name = "mm_ar"
    direction = Direction.REDUCE  # the steps are the reduce-scatter half's
    collective = c10d.all_reduce.default

    def match(self, collective: Node, taken: Taken) -> AllReduceSite | None:
        return match_all_reduce(collective, taken)

    def work(self, site: AllReduceSite, n: int) -> Work:
        bytes_per_block = site.product_bytes() / n
        return Work(
            self.direction,
            n,
            flops(site) / n,
            bytes_per_block,
            len(site.terms),
            then_gather=True,
            whole_bytes=site.whole_bytes(),
            matmul_class=site.terms[0].rate_class,
        )

    def lower(
        self, rw: Rewrite, site: AllReduceSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        _lower(rw, site, group, schedule, slices)


KIND = MmAr()


# ----------------------------------------------------------------------------------------
# lower


def _lower(rw: Rewrite, site: AllReduceSite, group: Group, schedule: Schedule, slices: int) -> None:
    """The reduce-scatter half on the ring; then one all-gather of this rank's reduced
    rows, the all-reduce's second half as it was."""
    em = rw.emit
    block, last = reduce_block(rw, site, group, schedule, slices)
    block = make_contiguous(em, block, last)
    gather = c10d.all_gather_into_tensor.default
    gathering = em(gather, (block, group.size, group.name), step=last, lane="comm")
    gathered = em(c10d.wait_tensor.default, (gathering,), step=last, lane="comm")
    result = view(em, gathered, val(site.wait).shape, last)
    replace_collective(rw, [site.collective], [site.wait], result)
