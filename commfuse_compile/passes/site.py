"""What every site kind provides to the pipeline (``SiteKind``), and what all sites share.

A site kind is one module in ``kinds/``: it finds its sites in a graph, says what they
cost, and lowers one with a schedule's steps. The stages (match, plan, lower, verify)
only talk to this interface, so a new pattern is one new module plus its entry in
``kinds.KINDS``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar

from torch.fx import Graph, Node

from .declines import Decline

if TYPE_CHECKING:
    from ..cost.simulator import Work
    from ..runtime.groups import Group
    from ..schedules import Schedule
    from .rewrite import Rewrite

T = TypeVar("T")
Direction = Literal["gather", "reduce", "exchange_in", "exchange_out"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Site(abc.ABC):
    """A match result: the nodes a kind found around one collective. Frozen: what the plan
    or the lowering leaves out makes a new site (``dataclasses.replace``)."""

    kind: ClassVar[str]
    group_name: str
    group_size: int
    declined: Decline | None = None

    @property
    @abc.abstractmethod
    def anchor(self) -> Node:
        """The site's first collective: sites are rewritten in its graph order."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What report.json shows of the site."""


def matched(candidates: Iterable[T], match: Callable[[T], Site | None]) -> list[Site]:
    """The sites ``match`` finds among a kind's candidate collectives (None: no site)."""
    return [site for site in map(match, candidates) if site is not None]


class SiteKind(Protocol):
    name: str
    direction: Direction  # which steps of a schedule run it (``Schedule.steps``)
    # can run inside one window of a site that shares its matmul and is rewritten first
    # (``match.find_sites`` orders such sites so)
    nests: bool

    def find(self, graph: Graph) -> list[Site]:
        """Every site of this kind in the graph, matched or declined (nothing rewritten)."""
        ...

    def rematch(self, site: Site) -> Site | None:
        """``site`` matched again where it stands after other sites were rewritten."""
        ...

    def without(self, site: Site, disabled: frozenset[str]) -> Site:
        """``site`` less the parts the ``disable`` option names (declines if none is left)."""
        ...

    def work(self, site: Site, n: int) -> Work:
        """Per-block matmul FLOPs and message bytes, for the cost model."""
        ...

    def start(self, site: Site) -> tuple[Site, Node]:
        """The site as it will be lowered, and the node its new nodes go before."""
        ...

    def lower(self, rw: Rewrite, group: Group, schedule: Schedule, slices: int) -> None:
        """Emit ``rw.site`` as ``schedule``'s steps for this rank of ``group``."""
        ...

    def replaced(self, site: Site) -> Sequence[Node]:
        """The nodes the rewrite replaces: erased at commit once nothing reads them."""
        ...

    def collectives(self, site: Site) -> Sequence[Node]:
        """The site's collectives (gone once it is rewritten)."""
        ...
