"""Verify the program Inductor generated from a rewritten graph, not only the graph.

Inductor plans memory on its own: it reuses a buffer as soon as its last reader ran and
reorders kernels within their dependencies. The FX graph the pass hands over can be
right while the program is not, so the wrapper code Inductor wrote (its ``call``
function, read with ``ast``) is replayed over a model of storage:

* every name is a view of one storage (an allocation, a graph input, an op's output),
  ``reinterpret_tensor`` gives an element range of it, ``a = b; del b`` reuses it;
* a transfer is in flight from its start to the ``wait_tensor`` that waits its work:
  a P2P send on the buffer it sends (``p2p.py`` registers it there), a P2P receive on
  its output, a functional collective on its output (its input is read until then);
* kernel arguments are reads or writes by the kernel's signature (``const`` C++
  pointers and Triton ``in_ptr`` are reads), ``out=`` is a write, ATen ops by schema.

While a transfer is in flight, its memory must not be freed, reused for another value,
or written, and a receiving buffer must not be read; every transfer must be waited.
A violation means the rewritten program would compute wrong numbers: the backend then
compiles the original graph instead. A transfer waited with no matmul run while it
was in flight is reported too (its overlap is lost, the numbers are right).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import itertools
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .sequence import START, WAIT, Event

P2P_CALL = "torch.ops.commfuse.p2p.default"
WAIT_CALL = "torch.ops._c10d_functional.wait_tensor.default"
COLLECTIVE_PREFIX = "torch.ops._c10d_functional."
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})
CHECKS = ("assert_", "torch._check")
ALLOCATORS = re.compile(r"^(empty_strided(_\w+)?|torch\.empty\w*)$")


class ProgramError(Exception):
    """The generated program cannot be read (not Python wrapper code, say)."""


@dataclasses.dataclass(frozen=True)
class View:
    storage: int
    start: int | None = None  # element range [start, end); None: the whole storage
    end: int | None = None

    def overlaps(self, other: View) -> bool:
        if self.storage != other.storage:
            return False
        if None in (self.start, self.end, other.start, other.end):
            return True
        return self.start < other.end and other.start < self.end  # type: ignore[operator]


@dataclasses.dataclass
class Flight:
    """One transfer's use of memory, from its start to the wait of its work."""

    what: str  # e.g. "receive 0 of site 0.2 step 1 (ag_mm)"
    view: View
    waited_on: int  # the storage whose wait_tensor completes it
    line: int
    writes: bool  # the transfer writes this memory (a receive, a collective's output)
    transfer: int  # which transfer (one P2P op or collective) it belongs to


@dataclasses.dataclass
class Result:
    violations: list[str]
    exposed: list[str]  # transfers waited with no matmul while they were in flight
    transfers: int
    sequence: list[Event]  # every start and wait of a transfer, in program order


GroupRanks = Callable[[str], tuple[int, ...]]


def check(code: str, group_ranks: GroupRanks | None = None) -> Result:
    """Replay ``code`` (Inductor's Python wrapper module) and return what it breaks.
    ``group_ranks`` gives a collective's group's global ranks (for ``sequence``)."""
    replay = _Replay(_kernel_writes(code), group_ranks)
    for statement in _flatten(_call_function(code).body):
        replay.statement(statement)
    replay.finish()
    return Result(replay.violations, replay.exposed, replay.transfers, replay.sequence)


def _call_function(code: str) -> ast.FunctionDef:
    """The wrapper's ``call`` function, parsed alone (the module around it is mostly
    kernel source in strings, which would cost most of the parse)."""
    found = re.search(r"^( *)def call\(", code, re.MULTILINE)
    if found is None:
        raise ProgramError("no call() function in the generated code")
    indent, lines = len(found.group(1)), code[found.start() :].splitlines()
    end = next(
        (
            i
            for i, line in enumerate(lines[1:], 1)
            if line.strip() and len(line) - len(line.lstrip()) <= indent
        ),
        len(lines),
    )
    # comments and shape asserts (most lines) are blanked: they touch no memory, and the
    # line numbers stay those of the code
    body = ["" if _metadata_only(line) else line for line in lines[:end]]
    try:
        tree = ast.parse(textwrap.dedent("\n".join(body)))
    except SyntaxError as err:
        raise ProgramError(f"call() is not Python ({err.msg})") from None
    function = tree.body[0]
    assert isinstance(function, ast.FunctionDef)
    return function


def _metadata_only(line: str) -> bool:
    return line.lstrip().startswith(("#", *CHECKS))


def _flatten(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    for statement in body:
        if isinstance(statement, ast.With):  # device guards, profiler ranges
            yield from _flatten(statement.body)
        else:
            yield statement


CPP_KERNEL = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\])", re.MULTILINE)
TRITON_KERNEL = re.compile(r"^(\w+) = async_compile\.triton\(", re.MULTILINE)


def _kernel_writes(code: str) -> dict[str, list[bool]]:
    """Kernel name -> which arguments it writes, from the kernels' definitions: C++
    pointers not ``const``, Triton parameters named ``out_ptr``/``in_out_ptr``."""
    kernels: dict[str, list[bool]] = {}
    for name, types in CPP_KERNEL.findall(code):
        kernels[name] = ["*" in t and not t.startswith("const") for t in ast.literal_eval(types)]
    for found in TRITON_KERNEL.finditer(code):
        name = found.group(1)
        signature = re.compile(rf"def {re.escape(name)}\(([^)]*)\)").search(code, found.end())
        if signature:
            params = [p.split(":")[0].strip() for p in signature.group(1).split(",")]
            kernels[name] = [p.startswith(("out_ptr", "in_out_ptr")) for p in params]
    return kernels


class _Replay:
    def __init__(
        self, kernel_writes: dict[str, list[bool]], group_ranks: GroupRanks | None
    ) -> None:
        self.kernel_writes = kernel_writes
        self.group_ranks = group_ranks
        self.sequence: list[Event] = []
        self.started: dict[int, Event] = {}  # transfer -> its start
        self.names: dict[str, View] = {}
        self.holders: collections.Counter[int] = collections.Counter()  # storage -> names
        self.p2p: dict[str, tuple[str, int]] = {}  # name of a P2P result -> (label, transfer)
        self.flights: list[Flight] = []
        self.matmuls_seen: dict[int, int] = {}  # transfer -> matmuls run while in flight
        self.labels: dict[int, str] = {}
        self.violations: list[str] = []
        self.exposed: list[str] = []
        self.transfers = 0
        self._storages = itertools.count()
        self.line = 0
        self.renamed: tuple[str, str] | None = None  # (new name, old name) of ``a = b``

    # -- storage model ------------------------------------------------------------------

    def fresh(self, name: str) -> None:
        self.bind(name, View(next(self._storages)))

    def bind(self, name: str, view: View | None) -> None:
        """Name ``view`` (None: forget the name), counting the names of each storage."""
        old = self.names.pop(name, None)
        if old is not None:
            self.holders[old.storage] -= 1
        if view is not None:
            self.names[name] = view
            self.holders[view.storage] += 1

    def view(self, expr: ast.expr) -> View | None:
        """The memory an argument expression names, if it is a buffer."""
        if isinstance(expr, ast.Name):
            return self.names.get(expr.id)
        if isinstance(expr, ast.Call) and ast.unparse(expr.func) == "reinterpret_tensor":
            base = self.view(expr.args[0])
            if base is None:
                return None
            try:
                size, stride, offset = (ast.literal_eval(a) for a in expr.args[1:4])
                end = offset + 1 + sum((s - 1) * st for s, st in zip(size, stride, strict=True))
                return View(base.storage, offset, end if all(size) else offset)
            except (ValueError, TypeError, SyntaxError):  # symbolic sizes: the whole storage
                return View(base.storage)
        return None

    # -- statements ---------------------------------------------------------------------

    def statement(self, node: ast.stmt) -> None:
        self.line = node.lineno
        if not isinstance(node, ast.Delete):
            self.renamed = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Tuple):  # ``a, b = args``: graph inputs
                for elt in target.elts:
                    if isinstance(elt, ast.Name):
                        self.fresh(elt.id)
            elif isinstance(target, ast.Name):
                self.assign(target.id, node.value)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            self.call(node.value, result=None)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.delete(target.id)

    def assign(self, name: str, value: ast.expr) -> None:
        if isinstance(value, ast.Name) or (
            isinstance(value, ast.Call) and ast.unparse(value.func) == "reinterpret_tensor"
        ):
            source = self.view(value)
            if source is not None:
                self.bind(name, source)
                self.renamed = (
                    name,
                    ast.unparse(value.args[0] if isinstance(value, ast.Call) else value),
                )
                return
        if (
            isinstance(value, ast.Subscript)
            and isinstance(value.value, ast.Name)
            and value.value.id in self.p2p
        ):  # a P2P op's received tensor
            label, transfer = self.p2p[value.value.id]
            self.fresh(name)
            index = ast.unparse(value.slice)
            self.start(f"receive {index} of {label}", self.names[name], name, True, transfer)
            return
        if isinstance(value, ast.Call):
            self.call(value, result=name)
            return
        self.fresh(name)

    def delete(self, name: str) -> None:
        """``del b``: frees b's storage unless another name holds it; right after
        ``a = b`` (or a reinterpretation of b) it hands the storage to a new value."""
        view = self.names.get(name)
        if view is None:
            return
        self.bind(name, None)
        new, source = self.renamed or ("", "")
        if source == name:
            for flight in self._in_flight(view):
                self.violate(
                    f"{name} is reused for {new} while {flight.what} (line {flight.line}) uses it"
                )
        elif not self.holders[view.storage]:
            for flight in self._in_flight(view):
                self.violate(f"{name} is freed while {flight.what} (line {flight.line}) uses it")

    def call(self, node: ast.Call, result: str | None) -> None:
        func = ast.unparse(node.func)
        if func == WAIT_CALL:
            self.wait(node.args[0])
        elif func == P2P_CALL:
            self.issue_p2p(node, result)
        elif func.startswith(COLLECTIVE_PREFIX):
            self.issue_collective(node, func, result)
        elif ALLOCATORS.match(func):
            if result:
                self.fresh(result)
        elif func.startswith(CHECKS):  # assert_size_stride and the like read metadata
            return
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            if node.func.value.id in self.names:  # a method of a buffer: copy_, zero_, ...
                self.access(node.func.value, node.func.attr.endswith("_"), func)
                for arg in node.args:
                    self.access(arg, False, func)
                if result:
                    self.fresh(result)
                return
            self.kernel(node, func, result)
        else:
            self.kernel(node, func, result)

    def kernel(self, node: ast.Call, func: str, result: str | None) -> None:
        """A kernel: check its reads and writes, count matmuls, name its output."""
        name = func.removesuffix(".run")
        writes = self.kernel_writes.get(name)
        schema = _schema(func)
        for i, arg in enumerate(node.args):
            if writes is not None:
                written = i < len(writes) and writes[i]
            elif schema is not None:
                written = _schema_writes(schema, i, None)
            else:
                written = not func.startswith("extern_kernels.")  # unknown kernel: assume so
            self.access(arg, written, func)
        for keyword in node.keywords:
            written = keyword.arg == "out" or (
                schema is not None and _schema_writes(schema, None, keyword.arg)
            )
            self.access(keyword.value, written, func)
        if func.startswith("extern_kernels.") and func.split(".")[-1] in MATMULS:
            for transfer in {f.transfer for f in self.flights} & self.matmuls_seen.keys():
                self.matmuls_seen[transfer] += 1
        if result:
            self.fresh(result)

    def access(self, arg: ast.expr, written: bool, func: str) -> None:
        items = arg.elts if isinstance(arg, (ast.List, ast.Tuple)) else [arg]
        for item in items:
            view = self.view(item)
            if view is None:
                continue
            for flight in self._in_flight(view):
                if written:
                    self.violate(
                        f"{func} writes {ast.unparse(item)} while {flight.what} "
                        f"(line {flight.line}) uses it"
                    )
                elif flight.writes:
                    self.violate(
                        f"{func} reads {ast.unparse(item)} before {flight.what} "
                        f"(line {flight.line}) is waited"
                    )

    # -- transfers ------------------------------------------------------------------------

    def new_transfer(self, label: str) -> int:
        self.transfers += 1
        self.matmuls_seen[self.transfers] = 0
        self.labels[self.transfers] = label
        return self.transfers

    def record(self, action: str, transfer: int, **fields: Any) -> None:
        """A start (with its peers or group) or, with the start's label, a wait."""
        if action == WAIT:
            event = dataclasses.replace(self.started[transfer], action=WAIT)
        else:
            event = self.started[transfer] = Event(action, transfer, **fields)
        self.sequence.append(event)

    def start(self, what: str, view: View, name: str, writes: bool, transfer: int) -> None:
        waited_on = self.names[name].storage
        self.flights.append(Flight(what, view, waited_on, self.line, writes, transfer))

    def issue_p2p(self, node: ast.Call, result: str | None) -> None:
        args = [_literal(a) for a in node.args]
        label = args[6] if len(args) > 6 else "a P2P op"
        transfer = self.new_transfer(label)
        self.record(
            START,
            transfer,
            label=label,
            group=args[5],
            tag=args[4],
            sends=tuple(args[1] or ()),
            recvs=tuple(args[3] or ()),
        )
        sends = node.args[0]
        for i, expr in enumerate(sends.elts if isinstance(sends, ast.List) else []):
            view = self.view(expr)
            if view is None:
                self.violate(f"{label} sends {ast.unparse(expr)}, which is not a buffer")
                continue
            self.flights.append(
                Flight(f"send {i} of {label}", view, view.storage, self.line, False, transfer)
            )
        if result:
            self.p2p[result] = (label, transfer)

    def issue_collective(self, node: ast.Call, func: str, result: str | None) -> None:
        """An out-of-place functional collective reads its inputs until its output is
        waited; an in-place one (name ending in ``_``) uses its tensors until then."""
        op = func.removeprefix(COLLECTIVE_PREFIX).split(".")[0]
        transfer = self.new_transfer(f"{op} (line {self.line})")
        names = [a for a in map(_literal, node.args) if isinstance(a, str)]
        group = names[-1] if names else ""
        ranks = self.group_ranks(group) if self.group_ranks and group else ()
        self.record(START, transfer, label=op, group=group, ranks=ranks)
        in_place = op.endswith("_")
        tensors = [v for v in map(self.view, _tensor_args(node)) if v is not None]
        if in_place:
            for view in tensors:
                self.flights.append(Flight(op, view, view.storage, self.line, True, transfer))
            return
        if result is None:
            return
        self.fresh(result)
        output = self.names[result]
        for view in tensors:
            self.flights.append(
                Flight(f"{op}'s input", view, output.storage, self.line, False, transfer)
            )
        self.flights.append(Flight(f"{op}", output, output.storage, self.line, True, transfer))

    def wait(self, arg: ast.expr) -> None:
        """``wait_tensor(x)`` waits every work registered on x's storage."""
        view = self.view(arg)
        if view is None:
            return
        done = [f for f in self.flights if f.waited_on == view.storage]
        self.flights = [f for f in self.flights if f.waited_on != view.storage]
        for transfer in dict.fromkeys(f.transfer for f in done):
            self.record(WAIT, transfer)
            if transfer in self.matmuls_seen and not self.matmuls_seen[transfer]:
                self.exposed.append(f"{self.labels[transfer]}: waited with no matmul in flight")
            self.matmuls_seen.pop(transfer, None)

    def finish(self) -> None:
        for flight in self.flights:
            self.violate(f"{flight.what} (line {flight.line}) is never waited")

    def _in_flight(self, view: View) -> list[Flight]:
        return [f for f in self.flights if f.view.overlaps(view)]

    def violate(self, what: str) -> None:
        self.violations.append(f"line {self.line}: {what}")


def _literal(expr: ast.expr) -> Any:
    """A literal argument's value (a peer list, a tag, a label); None for anything else."""
    try:
        return ast.literal_eval(expr)
    except (ValueError, TypeError, SyntaxError):
        return None


def _tensor_args(node: ast.Call) -> list[ast.expr]:
    args: list[ast.expr] = []
    for arg in node.args:
        args += arg.elts if isinstance(arg, (ast.List, ast.Tuple)) else [arg]
    return args


def _schema(func: str) -> torch.FunctionSchema | None:
    """The schema of ``torch.ops.ns.op.overload`` or ``aten.op.overload``, if known."""
    parts = func.split(".")
    if parts[:2] == ["torch", "ops"]:
        parts = parts[2:]
    if len(parts) != 3:
        return None
    try:
        overload = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None
    return getattr(overload, "_schema", None)


def _schema_writes(schema: torch.FunctionSchema, index: int | None, name: str | None) -> bool:
    for i, argument in enumerate(schema.arguments):
        if (index is not None and i == index) or (name is not None and argument.name == name):
            return bool(argument.alias_info is not None and argument.alias_info.is_write)
    return False
