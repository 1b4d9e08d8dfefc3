"""All-gather -> matmul: a matmul reads the gathered tensor, so each block of it can be
multiplied as soon as it arrives.

The collective's dim is followed through the reassembly DTensor emits (split + cat) and
through view/reshape into the matmul's rows, where any block of rows is an independent
piece of the product; transposed uses (weight gradients, gathered weights) contract or
fill columns block by block (``GatherUse.role``).

    # before                          # after (ring, rank r of n)
    x = wait(all_gather(x_r))         blk = x_r
    y = x @ w                         for s in range(n):
                                          nxt = p2p(send blk to r+1, recv from r-1)  # s < n-1
                                          y_[(r - s) % n] = blk @ w   # while nxt travels
                                          blk = wait(nxt)
                                      y = cat(y_)                # (rows; other roles: columns, K)

``site``: what a site is; ``find``: matching; ``place``: where its ring goes, and what it
leaves out to go there; ``lower``: what each piece computes, on the ring core.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from ....cost.simulator import Work
from ....runtime.groups import Group
from ....schedules import Direction, Schedule
from ...fx.graph import numel, val
from ...kit.rewrite import Rewrite, Taken
from ...kit.site_kind import SiteKind
from .find import gathers_by_shard, match
from .lower import lower_ring, lower_sliced
from .place import placed
from .site import AgMmSite


class AgMm(SiteKind[AgMmSite]):
    name = "ag_mm"
    roles = ("rows", "contract", "columns", "contract_left", "contract_k")
    direction = Direction.GATHER
    nests = True  # ``collective``: none, it finds a shard's gathers together

    def find(self, graph: Graph) -> list[AgMmSite]:
        found = (match(*item) for item in gathers_by_shard(graph).items())
        sites = [site for site in found if site is not None]
        beside = {s.beside.gather for s in sites if s.beside}
        return [s for s in sites if not beside & set(s.gathers)]

    def rematch(self, site: AgMmSite, taken: Taken) -> AgMmSite | None:
        gathers = [g for g in site.gathers if not g._erased]
        shard, n, group_name = gathers[0].args[:3]
        return match((shard, int(n), str(group_name)), gathers)  # type: ignore[arg-type]

    def without(self, site: AgMmSite, disabled: frozenset[str]) -> AgMmSite:
        return site.without_roles(disabled)

    def work(self, site: AgMmSite, n: int) -> Work:
        flops = sum(u.mm.flops() for u in site.uses)
        shards = (site.shard, *((site.beside.shard,) if site.beside else ()))
        shard_bytes = sum(numel(shard) * val(shard).element_size() for shard in shards)
        products, rebuilt = site.concatenated(n * shard_bytes)
        return Work(
            self.direction, n, flops / n, shard_bytes, len(site.uses),
            whole_bytes=site.whole_bytes(), matmul_class=site.uses[0].mm.rate_class,
            product_bytes=products, rebuilt_bytes=rebuilt, written_calls=len(site.gathers),
        )  # fmt: skip

    def start(self, site: AgMmSite, taken: Taken) -> tuple[AgMmSite, Node]:
        return placed(site, taken)

    def lower(
        self, rw: Rewrite, site: AgMmSite, group: Group, schedule: Schedule, slices: int
    ) -> None:
        if schedule.sliced:
            lower_sliced(rw, site, group, schedule, slices)
        else:
            lower_ring(rw, site, group, schedule)


KIND = AgMm()
