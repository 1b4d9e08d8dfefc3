"""Why a site is left as it was: every reason the pass can give, as data.

A reason has a stable code (``rs.not_sum``), the category the graph's summary counts
it under (``report.DECLINE_CATEGORIES``) and a message template filled with the site's names and
sizes. ``decline`` is the one way to decline a site; report.json carries the code and
the message; the table of reasons in docs/rewrites.md is generated from ``REASONS``
(``python -m commfuse_compile.passes.fx.declines`` prints it, for the page's declines
markers) and tests/test_declines.py keeps the two in sync.
"""

from __future__ import annotations

import dataclasses
import traceback
import warnings
from typing import Any

from ...report import DECLINE_CATEGORIES, log


@dataclasses.dataclass(frozen=True)
class Reason:
    code: str
    category: str  # a key of report.DECLINE_CATEGORIES
    template: str  # str.format over the fields ``decline`` is given


_REASONS = (
    # options and the cost model: expected, never a warning
    Reason("plan.off", "off", "schedule 'off' keeps every collective"),
    Reason("plan.kind_disabled", "disabled", "{kind} is disabled"),
    Reason("plan.roles_disabled", "disabled", "{unmatched}"),
    Reason("plan.schedule_disabled", "disabled", "schedule {schedule!r} is disabled"),
    Reason("plan.all_disabled", "disabled", "every schedule is disabled"),
    Reason(
        "plan.schedule_not_for_kind",
        "unsupported",
        "schedule {schedule!r} has no steps for {kind} sites (all-to-all sites run 'ring', "
        "the pairwise order, or 'auto')",
    ),
    Reason(
        "plan.not_profitable",
        "not_profitable",
        "not profitable: {runner_up} predicted {runner_up_us:.1f} us, collective "
        "{collective_us:.1f} us (a schedule must gain {gain:.0%})",
    ),
    # patterns the pass does not rewrite
    Reason("site.no_value", "unsupported", "node {node} has no tensor metadata (meta['val'])"),
    Reason(
        "site.dtype", "unsupported", "{what} has dtype {dtype}; only floating point is decomposed"
    ),
    Reason("site.group_of_one", "unsupported", "group of size 1: nothing to communicate"),
    Reason("site.group", "unsupported", "{error}"),
    Reason("site.wait", "unsupported", "{node} is used without exactly one wait_tensor"),
    Reason("site.lost", "unsupported", "no longer next to a matmul"),
    Reason("site.no_kind", "unsupported", "no site kind rewrites {pattern}"),
    Reason(
        "site.claimed",
        "unsupported",
        "{collective} is claimed by a {winner} site (a collective two kinds match goes to "
        "the first in kinds.KINDS that matched it)",
    ),
    Reason(
        "site.custom_op",
        "unsupported",
        "{node} calls {op}, which takes a process group ({argument}) and is no collective "
        "the pass knows (commfuse_compile.register_collective_op says which one it is)",
    ),
    Reason(
        "site.custom_op_unfit",
        "unsupported",
        "{node} calls {op}, known as a collective, but {problem}",
    ),
    Reason(
        "site.permuted",
        "unsupported",
        "{node} ({op}) reorders rows by an index between the collective and matmul {mm}: "
        "which rows a block holds is known only at run time",
    ),
    Reason(
        "site.grouped_mm",
        "unsupported",
        "{node} ({op}) is a grouped matmul: no site kind decomposes one",
    ),
    Reason(
        "ag.dims_differ",
        "unsupported",
        "the gathers of {shard} are reassembled along different dims",
    ),
    Reason("site.mutated", "unsupported", "the collected tensor is mutated in place by {node}"),
    Reason("ag.no_matmul", "unsupported", "no matmul consumes the gathered rows"),
    Reason(
        "ag.buffer_region",
        "unsupported",
        "{node} reads {read} of the buffer the gathered tensor is written into at "
        "{written}: not the region written",
    ),
    Reason("ag.matmuls_left_out", "unsupported", "{unmatched}"),
    Reason("site.no_reader", "unsupported", "the collected tensor has no reader"),
    Reason("site.unread", "unsupported", "the result of {node} is never read"),
    Reason("rs.taken", "unsupported", "its matmul was rewritten by all-gather site {site}"),
    Reason(
        "rs.padded",
        "unsupported",
        "uneven shards: the product is padded to a multiple of the group size",
    ),
    Reason(
        "rs.not_matmul",
        "unsupported",
        "reduce-scatter input is {node} ({op}) of a matmul, not a matmul or a sum of matmuls",
    ),
    Reason(
        "rs.no_matmul",
        "unsupported",
        "reduce-scatter input is {node} ({op}): no matmul computes it",
    ),
    Reason("rs.not_sum", "unsupported", "reduce op {op!r} is neither 'sum' nor 'avg'"),
    Reason(
        "rs.indivisible",
        "unsupported",
        "scattered dim {dim} of size {size} is not divisible by {n}",
    ),
    Reason(
        "rs.not_provably_divisible",
        "unsupported",
        "scattered dim {dim} of symbolic size {size} is not provably divisible by {n} "
        "(no guard is added)",
    ),
    Reason(
        "rs.product_shared", "unsupported", "product {node} is also used outside the reduce-scatter"
    ),
    Reason("site.empty", "unsupported", "{node} has a zero-size dim: nothing to overlap"),
    # plain TP's all-reduces split into sequence parallelism (shard_tokens): what stays
    # whole, and what it costs (the bytes in the record's match)
    Reason("split.output", "unsupported", "the value leaves the graph: it is read whole"),
    Reason(
        "split.random",
        "unsupported",
        "{op} is random: a draw on the shard would not be the rows of the whole draw",
    ),
    Reason("split.whole_reader", "unsupported", "{op} {why}: it reads every token"),
    Reason("split.indivisible", "unsupported", "the tokens cannot be shared out: {why}"),
    Reason(
        "split.no_matmul_after",
        "unsupported",
        "no matmul reads a value after it (read whole: {read}): no gather to hide, the "
        "all-reduce stays one site",
    ),
    Reason(
        "split.not_profitable",
        "not_profitable",
        "auto: the split predicted {split_us:.1f} us, the all-reduce sites {whole_us:.1f} "
        "us (a rewrite must gain {gain:.0%})",
    ),
    Reason("split.site", "unsupported", "its all-reduce site is declined: {why}"),
    Reason("split.planned", "unsupported", "its all-reduce site is not to be rewritten: {why}"),
    Reason(
        "split.unwaited", "unsupported", "the all-reduce is saved for the backward before its wait"
    ),
    Reason("split.ranks", "compiler", "the ranks' joint graphs or splits differ: {detail}"),
    # the collectives the sites leave in place, merged per group (passes/bucket.py): why
    # one goes into no bucket (in its site's record, ``bucket_code``)
    Reason("bucket.disabled", "disabled", "bucket is disabled"),
    Reason("bucket.alone", "unsupported", "no other {op} on group {group} ({reduce_op}, {dtype})"),
    Reason("bucket.unfit", "unsupported", "{node} {why}"),
    Reason(
        "bucket.read_early",
        "unsupported",
        "{node}'s value is read by {reader} before {later} starts: merged, that reader "
        "would wait for the later collective",
    ),
    Reason(
        "bucket.not_profitable",
        "not_profitable",
        "merged with {others}: {merged_us:.1f} us of exposed communication predicted, "
        "{apart_us:.1f} us apart (a bucket must gain {gain:.0%})",
    ),
    Reason(
        "ar.not_matmul",
        "unsupported",
        "all-reduce input is {node} ({op}), not a matmul or a sum of matmuls behind views",
    ),
    Reason(
        "ar.product_shared", "unsupported", "product {node} is also used outside the all-reduce"
    ),
    Reason("ar.not_sum", "unsupported", "reduce op {op!r} is neither 'sum' nor 'avg'"),
    Reason(
        "ar.indivisible",
        "unsupported",
        "the product's {size} rows (tokens) are not divisible by the group size {n}",
    ),
    Reason(
        "ar.not_provably_divisible",
        "unsupported",
        "the product's {size} rows (tokens) are not provably divisible by the group size {n}",
    ),
    Reason(
        "ar.batch_blocks",
        "unsupported",
        "the all-reduce's rows (dim 0) are along the batch (or the groups) of {node}",
    ),
    Reason("rs.shapes_differ", "unsupported", "the summed matmuls have different shapes ({node})"),
    Reason("rs.bias_rows", "unsupported", "bias of {node} has a row dim"),
    Reason("site.scales", "unsupported", "scaled matmul {node}: {problem}"),
    Reason(
        "rs.scaled_sum",
        "unsupported",
        "scaled matmul {node} computes {dtype}: float8 partial sums cannot be added as the "
        "reduce-scatter adds them (torch adds no float8 tensors)",
    ),
    Reason(
        "rs.batch_blocks",
        "unsupported",
        "the reduce-scatter's n blocks are along the batch (or the groups) of {node}",
    ),
    Reason(
        "site.blocks_lost",
        "unsupported",
        "the collective's n blocks do not stay blocks of one dim through {node} ({op}) on "
        "the way from matmul {mm}",
    ),
    Reason(
        "rs.not_a_block",
        "unsupported",
        "scattered dim {dim} of {shape} is neither a row block nor the column dim of the "
        "[{rows}, {cols}] product",
    ),
    Reason(
        "a2a.uneven",
        "unsupported",
        "{node} splits dim 0 into sizes the graph computes that are not one size ({splits}): "
        "where its blocks begin is known only at run time",
    ),
    Reason("a2a.splits", "unsupported", "{node}'s split sizes {splits} do not fit: {problem}"),
    Reason(
        "a2a.empty_block",
        "unsupported",
        "{node} sends or receives an empty block ({splits}): nothing to overlap it with",
    ),
    Reason(
        "a2a.rank_shapes",
        "unsupported",
        "{node} sends {sent} rows and receives {received} (splits {splits}): the ranks' "
        "graphs differ in shape, and the ranks agree on a rewrite only for graphs of one "
        "shape",
    ),
    Reason(
        "a2a.not_a_block",
        "unsupported",
        "the all-to-all's n blocks do not stay blocks through {node} ({op})",
    ),
    Reason(
        "moe.side_effect",
        "unsupported",
        "{node} ({op}) writes in place, or has side effects, before the combine",
    ),
    Reason(
        "moe.grouped_form",
        "unsupported",
        "grouped matmul {node} is not expert rows by a weight per group (3-D), with the "
        "offsets every grouped matmul of the experts shares and no bias",
    ),
    Reason(
        "moe.no_put_back", "unsupported", "the experts' output is never put back by the permutation"
    ),
    Reason(
        "moe.no_combine",
        "unsupported",
        "{node}, the tokens put back, goes to no all-to-all that reverses the dispatch",
    ),
    Reason("moe.size", "unsupported", "size {node} of a replaced tensor is not its row count"),
    Reason(
        "moe.pad_kept",
        "unsupported",
        "the rows appended to the dispatched tokens are not dropped after the put-back "
        "{node} ({why})",
    ),
    Reason(
        "a2a.batch_blocks",
        "unsupported",
        "the all-to-all's n blocks are along the batch of the batched matmul {node}",
    ),
    Reason(
        "a2a.product_shared",
        "unsupported",
        "product {node} is also used outside the all-to-all",
    ),
    Reason("a2a.bias_rows", "unsupported", "bias of {node} has a row dim"),
    Reason("a2a.no_matmul", "unsupported", "no matmul reads the all-to-all's blocks"),
    Reason("a2a.matmuls_left_out", "unsupported", "{unmatched}"),
    Reason(
        "lower.not_fake",
        "unsupported",
        "graph values are not fake tensors; cannot compute new node metadata",
    ),
    Reason(
        "lower.late_input", "unsupported", "input {node} is computed after the site and cannot move"
    ),
    Reason(
        "lower.slices",
        "unsupported",
        "slicing: {k} chunks do not{provably} divide {what} of size {size}",
    ),
    Reason(
        "lower.scale_beside",
        "unsupported",
        "slicing: a chunk of {node} is {size} bytes, not a multiple of 16: the scales "
        "gathered beside it cannot follow it in one message",
    ),
    Reason(
        "lower.scaled_block",
        "unsupported",
        "the kernel refuses a block of scaled matmul {node}: {error}",
    ),
    Reason(
        "size.expression", "unsupported", "cannot compute the symbolic size {expr} in the graph"
    ),
    Reason("size.no_source", "unsupported", "no graph input holds the symbolic size {symbol}"),
    Reason("size.computed", "unsupported", "size {node} is computed from a replaced tensor"),
    Reason("size.not_symint", "unsupported", "size {node} of a replaced tensor is not a SymInt"),
    Reason("size.constant", "unsupported", "size {node} of a replaced tensor is a constant"),
    # the compiler below the pass
    Reason("compiler.failed", "compiler", "inner compiler failed on the rewritten graph: {error}"),
    Reason(
        "compiler.comm_passes",
        "compiler",
        "Inductor's {passes} would change the graph's collectives after the Inductor pass, "
        "which cannot read the program back: the ranks would agree on transfers that are "
        "not the ones compiled (switch them off, or use backend='commfuse')",
    ),
    Reason(
        "compiler.unreadable",
        "compiler",
        "the inner compiler's program cannot be read, so it cannot be verified",
    ),
    Reason(
        "compiler.unverifiable",
        "compiler",
        "the inner compiler's program cannot be verified: {error}",
    ),
    Reason(
        "compiler.breaks_buffer",
        "compiler",
        "the inner compiler's program breaks a transfer's buffer: {violations}",
    ),
    # the ranks' programs, compared across the ranks (every rank falls back together)
    Reason(
        "compiler.rank_decisions",
        "compiler",
        "ranks {ranks} rewrote this graph differently ({detail})",
    ),
    Reason(
        "compiler.rank_order",
        "compiler",
        "the ranks' programs start transfers in different orders, which can hang: {detail}",
    ),
    Reason(
        "compiler.rank_deadlock",
        "compiler",
        "the ranks' programs, run together, would hang: {detail}",
    ),
    Reason(
        "compiler.rank_graphs",
        "compiler",
        "the ranks of {group} compiled different graphs ({detail})",
    ),
    Reason(
        "compiler.rank_absent",
        "compiler",
        "ranks {ranks} of {group} did not compile this graph: {why}",
    ),
    # faults of the pass itself (each one also warns)
    Reason("internal.error", "internal", "internal error: {error}"),
    Reason("internal.unpacked", "internal", "internal: {node} outputs are not all unpacked"),
    Reason(
        "internal.recv_wait",
        "internal",
        "internal: a tensor {node} receives is not waited exactly once",
    ),
    Reason(
        "internal.send_wait", "internal", "internal: a buffer {node} sends is not waited after it"
    ),
    Reason("internal.collective_wait", "internal", "internal: {node} is not waited exactly once"),
    Reason(
        "internal.replacement",
        "internal",
        "internal: replacement of {node} changes its value's shape/dtype",
    ),
    Reason(
        "internal.collective_left",
        "internal",
        "internal: a rewritten site still has its collective",
    ),
    Reason(
        "internal.dead", "internal", "internal: the rewrite computes values nothing reads: {nodes}"
    ),
    Reason(
        "internal.peers",
        "internal",
        "internal: P2P peers {emitted} are not the schedule's {expected}",
    ),
    Reason(
        "internal.shapes",
        "internal",
        "internal: {node} sends and receives different shapes {shapes}",
    ),
    Reason("internal.schedule", "internal", "internal: schedule {schedule} on {n} ranks: {error}"),
    Reason("internal.slicing", "internal", "internal: slicing with {k} chunks: {error}"),
)
REASONS = {reason.code: reason for reason in _REASONS}


@dataclasses.dataclass(frozen=True)
class Decline:
    """A found site's decline, kept on the (frozen) site until the pipeline reports it."""

    code: str
    reason: str

    def error(self) -> Declined:
        return Declined(self.code, self.reason, REASONS[self.code].category)


class Declined(Exception):
    """Raised by ``decline``: the site is left as it was, for ``reason``; ``traceback``:
    the unexpected error's it stands for (``failed``), else empty."""

    def __init__(self, code: str, reason: str, category: str) -> None:
        super().__init__(reason)
        self.code, self.reason, self.category = code, reason, category
        self.traceback = ""

    def kept(self) -> Decline:
        return Decline(self.code, self.reason)


def decline(code: str, **fields: Any) -> Declined:
    """The one way to decline a site: ``raise decline("rs.not_sum", op=op)``."""
    reason = REASONS[code]
    return Declined(code, reason.template.format(**fields), reason.category)


def failed(
    err: BaseException, strict: bool, outcome: str, code: str = "internal.error"
) -> Declined:
    """The one way an unexpected exception becomes a decline (``code``, whose template
    takes ``error``; a ``Declined`` is one already): re-raised under the ``strict``
    option; else warned, with ``outcome`` (what the pass does instead), its traceback
    logged at DEBUG to the ``commfuse`` log and kept on the decline (the site's record)."""
    if isinstance(err, Declined):
        return err
    if strict:
        raise err
    why = decline(code, error=f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}")
    why.traceback = "".join(traceback.format_exception(err))
    log.debug("commfuse: %s: %s\n%s", outcome, why.reason, why.traceback)
    warnings.warn(
        f"commfuse: {outcome}: {why.reason} (the traceback: report.json's record, "
        'TORCH_LOGS="+commfuse"; COMMFUSE_STRICT=1 raises it)',
        stacklevel=3,
    )
    return why


def markdown_table() -> str:
    """The table of reasons in docs/rewrites.md (between its declines markers), one row
    per code; ``python -m commfuse_compile.passes.fx.declines`` prints it."""
    rows = ["| code | counted as | message |", "|---|---|---|"]
    for reason in _REASONS:
        message = reason.template.replace("|", "\\|")
        rows.append(f"| `{reason.code}` | {DECLINE_CATEGORIES[reason.category]} | {message} |")
    return "\n".join(rows)


assert all(r.category in DECLINE_CATEGORIES for r in _REASONS)

if __name__ == "__main__":
    # the table for docs/rewrites.md: paste it between the page's declines markers
    print(markdown_table())
