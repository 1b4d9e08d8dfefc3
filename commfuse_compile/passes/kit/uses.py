"""Sites whose collected tensor several matmuls read (all-gather -> matmul, all-to-all ->
matmul): each reading matmul is a ``Use`` with a role, and what the pipeline or the
lowering cannot keep is left out of the site with a note, the same way for every kind.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar, Self, TypeVar

from torch.fx import Node

from ..fx.collectives import saved_unwaited
from ..fx.declines import decline
from ..fx.graph import data_users, nbytes, position, writes_into
from ..fx.matmuls import Matmul
from .site import Site

# roles where the collected tensor is the matmul's first operand (A); in the others
# ("columns", "contract_left") it is the second (B)
COLLECTED_AS_A = ("rows", "contract", "contract_k")
OWN_RESULT = "its other operand is computed from this site's own result"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Use:
    """A matmul reading the collected tensor, and what a block of it computes there."""

    mm: Matmul
    role: str

    @property
    def operands(self) -> tuple[Node, Node]:
        """(the operand that is a layout of the collected tensor, the other)."""
        mm = self.mm
        return (mm.a, mm.b) if self.role in COLLECTED_AS_A else (mm.b, mm.a)

    def note(self, why: str) -> str:
        return f"{self.mm.node.name} ({self.role}): {why}"

    def whole_bytes(self) -> float:
        """What each block's matmul reads whole: the other operand, where a block is rows
        or columns of the product; nothing where the blocks cut K (both operands cut)."""
        if self.role.startswith("contract"):
            return 0.0
        return self.mm.whole_bytes(self.role == "columns")


U = TypeVar("U", bound=Use)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UsesSite(Site):
    """A site of matmuls that read one collected tensor (``uses``); ``unmatched``: the
    matmuls left reading it, and why."""

    LEFT_OUT: ClassVar[str]  # the decline code of a site with no use left
    uses: tuple[Use, ...] = ()
    unmatched: tuple[str, ...] = ()

    def whole_bytes(self) -> float:
        """What every block's matmuls read whole (``Work.whole_bytes``)."""
        return sum(u.whole_bytes() for u in self.uses)

    def concatenated(self, collected_bytes: float) -> tuple[float, float]:
        """What the rewrite concatenates from its blocks (``Work.product_bytes`` and
        ``rebuilt_bytes``): the products of the uses whose blocks are their rows or columns
        (a contracting use sums its blocks instead), and the collected tensor, of
        ``collected_bytes``, where it outlives the site."""
        products = sum(nbytes(u.mm.node) for u in self.uses if u.role in ("rows", "columns"))
        rebuilt = collected_bytes if self.outlives() else 0.0
        return products, rebuilt

    @property
    @abc.abstractmethod
    def results(self) -> Sequence[Node]:
        """The collectives' waits."""

    @property
    @abc.abstractmethod
    def chain(self) -> Sequence[Node]:
        """The nodes between the waits and the matmuls."""

    def leaving_out(self, left: Mapping[U, str]) -> Self:
        """This site without the uses in ``left`` (use -> why), which are noted; declined
        (``LEFT_OUT``) if no use is left."""
        unmatched = (*self.unmatched, *(u.note(why) for u, why in left.items()))
        uses = tuple(u for u in self.uses if u not in left)
        if not uses:
            raise decline(self.LEFT_OUT, unmatched="; ".join(unmatched))
        return dataclasses.replace(self, uses=uses, unmatched=unmatched)

    def without_roles(self, disabled: frozenset[str]) -> Self:
        """The site less the uses whose role the ``disable`` option names."""
        left = {u: "disabled" for u in self.uses if u.role in disabled}
        if not left:
            return self
        if len(left) == len(self.uses):
            unmatched = (*self.unmatched, *(u.note(why) for u, why in left.items()))
            raise decline("plan.roles_disabled", unmatched="; ".join(unmatched))
        return self.leaving_out(left)

    def without_own_result(self, before: Node) -> Self:
        """A matmul whose other operand is computed from this site's own result (a
        consumer reached again later, e.g. dX = dY @ W where dY comes from W's recomputed
        forward) cannot share the site's steps, which must be done by ``before``: it
        keeps reading the (rebuilt) collected tensor instead."""
        own = {*self.results, *self.chain, *(u.mm.node for u in self.uses)}
        late = needs_own_result([u.mm for u in self.uses], own, before)
        left = {u: OWN_RESULT for u in self.uses if u.mm in late}
        return self.leaving_out(left) if left else self

    def outlives(self) -> bool:
        """Is the collected tensor read by anything other than the site's matmuls?"""
        inside = {*self.chain, *(u.mm.node for u in self.uses)}
        readers = (user for node in (*self.results, *self.chain) for user in data_users(node))
        saved = any(saved_unwaited(c) for c in self.collectives)
        return saved or any(user not in inside for user in readers)


def check_read_only(user: Node, node: Node) -> None:
    """Declines the site if ``user`` writes into ``node`` (the collected tensor or a view
    of it): its blocks would no longer be what the ring moved. Reading it in place, as
    the source of a ``copy_`` into a buffer, is a reader like any other (``outlives``)."""
    if writes_into(user, node):
        raise decline("site.mutated", node=user.name)


def without_read_twice(uses: Sequence[U], own: set[Node], what: str) -> tuple[list[U], list[str]]:
    """(the uses, notes on those left out): a matmul whose other operand is the collected
    tensor too (``G @ G^T``) has no sum or concatenation of products of one operand's
    blocks, and keeps reading the tensor."""
    twice = {u.mm.node: u for u in uses if u.operands[1] in own}  # one note per matmul
    notes = [f"{mm.name}: reads the {what} tensor as both operands" for mm in twice]
    return [u for u in uses if u.mm.node not in twice], notes


def needs_own_result(matmuls: Iterable[Matmul], own: set[Node], before: Node) -> list[Matmul]:
    """The matmuls whose other operands are computed, after ``before``, from ``own`` (the
    site's own nodes)."""
    start = position(before)

    def depends(node: Node) -> bool:
        stack, seen = [node], set()
        while stack:
            current = stack.pop()
            if current in own:
                return True
            if position(current) >= start and current not in seen:
                seen.add(current)
                stack += current.all_input_nodes
        return False

    return [mm for mm in matmuls if any(depends(op) for op in mm.inputs if op not in own)]
