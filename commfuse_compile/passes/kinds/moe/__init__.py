"""All-to-all -> experts -> all-to-all: a dropless MoE layer with expert parallelism
(torchtitan's token dispatcher), one site for both all-to-alls. The tokens peer j sends
are run through the experts as soon as they arrive and sent straight back to j, while
the next peer's arrive; this rank's own tokens, which travel nowhere, run in two halves,
under the first transfer and under the last (``schedules/round_trip.py``).

What the graph holds (the splits are the graph's own sizes, from ``.tolist()``):
    recv = wait(all_to_all_single(x, out_splits, in_splits))    # dispatch, uneven
    xp = recv[perm]                                               # rows sorted by expert
    ... _grouped_mm(., W, offs), pointwise ops, casts ...         # the experts
    y = new_empty(...).index_put([perm], out)                     # rows put back
    wait(all_to_all_single(y, in_splits, out_splits))            # combine

The same layer after (rank r of n; n + 1 steps of ``round_trip``):
    step 0:    send the tokens for r+1, receive r-1's   | experts(own tokens, first half)
    step s:    send/receive the next peer's tokens       | experts(peer r-s's block, sorted by
               and send peer r-s+1's result back         |   expert, its own offsets, unsorted)
    step n:    receive the last result                   | experts(own tokens, second half)
    y = cat(the results, in the combine's order)

Every op between ``xp`` and ``out`` computes a row from that row alone (a grouped
matmul with its group's weight: group g holds rows offs[g-1] to offs[g]), so row i of
``recv`` goes through expert ``g(i) = bucketize(pinv[i], offs, right=True)``, ``pinv``
inverting ``perm``: a property of the program, not of how ``perm`` was built. Each
peer's block of ``recv`` is sorted by g, run through the experts with its own offsets,
and unsorted. ``perm`` must be a permutation of the rows: it has their count, and the
program's ``index_put`` would leave rows unwritten otherwise.
"""

from __future__ import annotations

from torch.fx import Node

from ....cost.simulator import Work
from ....runtime.groups import Group
from ....schedules import Direction, Schedule, round_trip
from ...fx import dims
from ...fx.collectives import ALL_TO_ALL
from ...fx.graph import moved_bytes, node_arg, numel, val
from ...fx.matmuls import rate_class_of
from ...kit.rewrite import Rewrite, Taken
from ...kit.site_kind import AtCollective, Peers
from .find import match as match_dispatch
from .lower import lower, peers
from .site import MoeSite

__all__ = ["KIND", "MoeSite", "peers"]


class Moe(AtCollective[MoeSite]):
    name = "moe"
    direction = Direction.ROUND_TRIP
    collective = ALL_TO_ALL

    def match(self, collective: Node, taken: Taken) -> MoeSite | None:
        return match_dispatch(collective)

    def work(self, site: MoeSite, n: int) -> Work:
        """The grouped matmuls' FLOPs, the dispatched and the returned bytes: the round
        trip the lowering runs. The rows received are known only at run time (torch hints
        each unbacked split at thousands, and a compile can move the hint): they are taken
        as many as this rank sends where that is a static count (the tokens it routed:
        balanced routing), at the hints otherwise; each peer's rows go and come back
        (the dispatch's and the combine's row widths)."""
        assert site.dispatch_wait is not None
        received = val(site.dispatch_wait).shape[0]
        sent = val(node_arg(site.dispatch, 0, "input")).shape[0]
        rows = sent if isinstance(sent, int) else dims.hint(received)
        scale = rows / dims.hint(received)
        flops = sum(_flops(mm) for mm in site.grouped) * scale

        def block_bytes(collective: Node) -> float:
            row = numel(collective) / max(1, dims.hint(val(collective).shape[0]))
            return rows * row * val(collective).element_size() / n

        back = None if site.combine is None else block_bytes(site.combine)
        moved = sum(moved_bytes(node) for node in _memory_ops(site)) * scale / n
        return Work(
            self.direction, n, flops / n, block_bytes(site.dispatch), len(site.grouped),
            back_bytes=back, block_ops=block_ops(site), block_op_bytes=moved,
            matmul_class=rate_class_of(site.grouped[0]),
        )  # fmt: skip

    def start(self, site: MoeSite, taken: Taken) -> tuple[MoeSite, Node]:
        assert site.permuted is not None, "a matched site has its permuted read"
        return site, site.permuted

    def lower(
        self, rw: Rewrite, site: MoeSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        lower(rw, site, group)

    def expected_peers(
        self, site: MoeSite, group: Group, schedule: Schedule, slices: int
    ) -> list[Peers]:
        return peers(group)  # its own round trip, whatever the schedule

    def check_schedule(self, schedule: Schedule, n: int) -> None:
        round_trip.check(n)

    def alike_from(self, site: MoeSite) -> int | None:
        return None  # each peer's block has the graph's own split sizes


KIND = Moe()


def block_ops(site: MoeSite) -> int:
    """The op calls ``lower`` runs on each block besides its grouped matmuls: the sort by
    expert, the block's rows in that order, its offsets (two ops), the experts' other
    ops, the paired tensors' rows and the rows' places where read, the output unsorted
    (two ops)."""
    placed = bool(site.saved or site.paired)
    return 7 + len(site.experts) - len(site.grouped) + len(site.paired) + placed


def _memory_ops(site: MoeSite) -> list[Node]:
    """The ops between the all-to-alls that move rows rather than multiply them: the
    sorted read, the experts' other ops, the rows put back."""
    grouped = set(site.grouped)
    nodes = (site.permuted, *site.experts, site.put_back)
    return [node for node in nodes if node is not None and node not in grouped]


def _flops(mm: Node) -> float:
    """A grouped matmul's: rows by a weight per group ([rows, N] from K), or a sum over
    the rows per group ([groups, K, N]: each row in one group's sum)."""
    a = node_arg(mm, 0, "self")
    assert isinstance(a, Node)
    out = val(mm)
    per_group = out.shape[0] if out.dim() == 3 else 1
    return 2 * numel(mm) / dims.hint(per_group) * dims.hint(val(a).shape[-1])
