"""What ``commfuse bench`` measures, shared by the modules that run the measurements
(``run``, ``cells``, ``block``) and ``figures`` (which turns them into
figures): its rows, the shapes of its sites and of its block, the label of the row
that probes the machine's own overlap, and the progress lines of a run."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

OVERLAP_PROBE = "both at once"  # comm alone with the matmul run meanwhile (cells._comm)
# the label prefix of a block's rows in its compared layout (the plain-TP block's: the
# same block with sequence parallelism written by hand)
COMPARED = "TP+SP "

# The capacity-MoE cell (dispatch all-to-all -> batched experts -> combine all-to-all):
# each rank holds this many experts; its ``SiteShape.seq`` is the rank's token slots
# (n x experts per rank x capacity), its ``ffn`` every expert's hidden size (not sharded)
MOE_KIND = "a2a_experts_a2a"
EXPERTS_PER_RANK = 2
# The dropless-MoE cell (torchtitan: token counts exchanged, ``.tolist()`` splits, uneven
# dispatch all-to-all -> grouped-GEMM SwiGLU experts in bfloat16 -> combine all-to-all):
# ``SiteShape.seq`` is the rows this rank dispatches (tokens x top-k), ``ffn`` every
# expert's hidden size; ``EXPERTS_PER_RANK`` experts per rank; the pass's ``moe`` site
DROPLESS_KIND = "a2a_gmm_a2a"
# skewed routing (``SiteShape.skew``): each rank sends this many times the average rows
# to one peer (``sites.dropless_routing``)
DROPLESS_SKEW = 2.0
# plain TP served: prefills and decode steps of its all-reduce sublayer (``served``)
SERVED_KIND = "served"
SERVED_SITE = "mm_ar_mm"  # the site each served cell measures
# every cell kind (``commfuse bench --kinds``): TP+SP's, Ulysses', plain TP's, the MoEs',
# plain TP served
CELL_KINDS = (
    *("ag_mm", "mm_rs", "mm_a2a", "a2a_mm", "mm_ar_mm", MOE_KIND, DROPLESS_KIND),
    SERVED_KIND,
)
# bit/s of the link while calibrating the profile ``auto`` uses (``link.LinkProfiles``)
REFERENCE_RATE = 1e9
# and a second rate it is calibrated at, below most cells' (146-3,900 Mbit/s): gloo's
# collectives lose more to the wire than its bytes at low rates (two 256 KiB all-to-alls
# took 19.5 ms at 308 Mbit/s, 43 % over the wire's time, where 1 Gbit/s's scaled said 15.2)
LOW_RATE = 250e6
# A cell's rows are timed over at least this long, in at most ``MAX_ROUNDS`` rounds: a
# decode step's rows take a few milliseconds, and 9 of them left the same program's two
# rows 1.6x apart (the full run's noise at 4 tokens: 111 %). At 1.5 s the full run's
# 10-30 ms cells got 9-19 rounds, and 20 of its 29 rows beyond the model's 25 % were
# theirs (a baseline's median 22.1 ms where its parts alone took 17.4, min 12.9).
CELL_TIMED_S = 6.0
MAX_ROUNDS = 120
# A call shorter than this is timed as several back to back after one barrier, their
# mean: the ranks leave a barrier a median 0.03 ms apart but at times 0.9-3.0 ms, which
# a call of a few milliseconds timed alone carries whole (a decode loop runs its steps
# back to back).
MIN_TIMED_S = 0.02
MAX_CALLS_PER_TIMING = 16
# a row's model error with the cell's compute at the speed it ran at
# (``profiles.at_compute_speed``), and the results' distribution of it
AT_CELL_SPEED = "model_error_at_cell_speed"
AT_CELL_SPEED_TITLE = "model error at each cell's compute speed"


def parse_kinds(text: str) -> tuple[str, ...]:
    """An argparse type: a comma-separated list of ``commfuse bench``'s cell kinds."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in CELL_KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown cell kind {', '.join(map(repr, unknown)) or repr(text)}: "
            f"one or more of {', '.join(CELL_KINDS)}"
        )
    return kinds


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row: a schedule with its options (``off`` is the baseline)."""

    label: str
    schedule: str
    slices: int | None = None

    def options(self, profile: str | None) -> dict[str, Any]:
        options: dict[str, Any] = {"schedule": self.schedule}
        if self.slices is not None:
            options["slices"] = self.slices
        if profile is not None:
            options["profile"] = profile
        return options


@dataclasses.dataclass(frozen=True)
class SiteShape:
    """A TP+SP linear: sequence ``seq`` (sharded), model width ``dim``, hidden ``ffn``
    (column-parallel up-projection ``dim -> ffn``, row-parallel down ``ffn -> dim``)."""

    seq: int
    dim: int
    ffn: int
    skew: float = 1.0  # the dropless-MoE cell's routing (1: every peer the same rows)

    @property
    def label(self) -> str:
        skewed = f" skew {self.skew:g}x" if self.skew != 1.0 else ""
        return f"S={self.seq} D={self.dim} F={self.ffn}{skewed}"

    def fitted(self, n: int, kind: str | None = None) -> SiteShape:
        """The shape on ``n`` ranks: the sequence and the hidden size rounded down to
        multiples of n (each rank's shard the same size; 2048 -> 2046 on 3 ranks). The
        MoE cell's slots are rounded down to n x ``EXPERTS_PER_RANK`` blocks of one
        capacity (2048 -> 2046 on 3 ranks), its experts' hidden size kept (not sharded);
        the dropless cell's rows likewise (n x ``EXPERTS_PER_RANK`` equal groups when
        balanced)."""
        if kind in (MOE_KIND, DROPLESS_KIND):
            return dataclasses.replace(self, seq=self.seq - self.seq % (n * EXPERTS_PER_RANK))
        return dataclasses.replace(self, seq=self.seq - self.seq % n, ffn=self.ffn - self.ffn % n)


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """The whole-layer figure's block. The sequence stays at 256: from 384 tokens on,
    the pass declines the block's all-gather sites here ("slice sits between the
    gathered tensor and a matmul"), so a longer block would measure the collectives.
    Front "moe": one of training's MoE layers (``training.moe``, its kind ``moe``:
    "capacity" or "dropless") on ``seq`` tokens per rank, ``experts`` experts per rank of
    hidden size ``hidden`` (``heads`` unused)."""

    seq: int
    dim: int
    heads: int
    hidden: int
    batch: int = 1
    # training's front end: "tp" (TP+SP over every rank) or "fsdp"; or "moe" (expert
    # parallel over every rank, the bench's own capacity-MoE layer)
    front: str = "tp"
    tp: int = 1  # front "fsdp": the tensor-parallel mesh dim, the rest data parallel
    # front "tp": False is plain TP (an all-reduce after each row-parallel linear, every
    # token on every rank), which the pass splits into TP+SP's collectives
    sequence_parallel: bool = True
    experts: int = EXPERTS_PER_RANK  # front "moe": experts per rank
    moe: str = "capacity"  # front "moe": training.moe's block, "capacity" or "dropless"

    def mesh(self, world_size: int) -> str:
        """How the block's ranks are laid out."""
        if self.front == "moe":
            return f"ep={world_size}, {self.experts} experts per rank"
        if self.front == "fsdp" and self.tp > 1:
            return f"dp={world_size // self.tp} x tp={self.tp}"
        if not self.sequence_parallel:
            return f"plain tp={world_size}"
        return f"{self.front}={world_size}"

    @property
    def label(self) -> str:
        if self.front == "moe":  # S: tokens per rank; top-2 of E = n x experts per rank
            return f"S={self.seq} D={self.dim} F={self.hidden} top-2 {self.moe}"
        return f"S={self.seq} D={self.dim} H={self.heads} F={self.hidden} B={self.batch}"

    def fitted(self, n: int) -> BlockShape:
        """The block on ``n`` tensor-parallel ranks (front "tp"): the heads, the hidden
        size and the sequence rounded up to multiples of n, the head dim kept (4 heads of
        64 become 6 on 3 ranks: D=384). Unchanged where n divides them already."""
        if self.front != "tp":
            return self

        def up(x: int) -> int:
            return -(-x // n) * n

        heads = up(self.heads)
        dim = heads * (self.dim // self.heads)
        return dataclasses.replace(
            self, heads=heads, dim=dim, hidden=up(self.hidden), seq=up(self.seq)
        )


class Progress:
    """One line per stage, with the elapsed time: what the run is doing now."""

    def __init__(self, total: int, echo: Callable[[str], None]) -> None:
        self.total, self.done, self.echo = total, 0, echo
        self.start = time.monotonic()

    def stage(self, text: str) -> None:
        minutes, seconds = divmod(round(time.monotonic() - self.start), 60)
        self.echo(f"[{self.done}/{self.total} {minutes:02d}:{seconds:02d}] {text}")

    def advance(self) -> None:
        self.done += 1


@dataclasses.dataclass(frozen=True)
class ServedBench:
    """The served block's width ``dim`` and hidden size ``ffn``; the prompt lengths of
    its prefills and the batch sizes of its decode steps."""

    dim: int
    ffn: int
    prompts: tuple[int, ...]
    batches: tuple[int, ...]
    ratio: float = 1.0  # the middle prompt's comm/compute, which sets the link's rate

    def shapes(self) -> list[tuple[str, SiteShape]]:
        return [("prefill", SiteShape(t, self.dim, self.ffn)) for t in self.prompts] + [
            ("decode", SiteShape(b, self.dim, self.ffn)) for b in self.batches
        ]
