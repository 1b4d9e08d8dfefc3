"""What every site shares: the nodes a kind found around one collective (``Site``).

A site kind (``site_kind.SiteKind``, one module in ``kinds/``) finds sites, says what
they cost and lowers them; the stages read a site only through this class.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from torch.fx import Node

from ..fx.declines import Decline


@dataclasses.dataclass(frozen=True, kw_only=True)
class Site(abc.ABC):
    """A match result. Frozen: what the plan or the lowering leaves out makes a new site
    (``dataclasses.replace``)."""

    kind: ClassVar[str]
    group_name: str
    group_size: int
    declined: Decline | None = None

    @property
    @abc.abstractmethod
    def collectives(self) -> Sequence[Node]:
        """The site's collectives (gone once it is rewritten)."""

    @property
    def anchor(self) -> Node:
        """The site's first collective: sites are rewritten in its graph order."""
        return self.collectives[0]

    @abc.abstractmethod
    def replaced(self) -> Sequence[Node]:
        """The nodes the rewrite replaces: erased at commit once nothing reads them."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What report.json shows of the site."""
