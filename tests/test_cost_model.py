"""The cost model: the simulator's timelines, the plan stage's choice, profiles, options and
the calibration fit. Properties of the model on every built-in profile, no measurement."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist
from cases import AgMm, MmRs, trace
from torch.testing._internal.distributed.fake_pg import FakeStore

from commfuse_compile import CommfuseOptionError, Options
from commfuse_compile.cost.profile_checks import COLLECTIVES
from commfuse_compile.cost.profiles import (
    BUILTIN,
    Curve,
    MatmulRate,
    Profile,
    ProfileError,
    at_compute_speed,
    load,
    save,
)
from commfuse_compile.cost.simulator import (
    SCHEDULES,
    Event,
    Timeline,
    Work,
    collective_call_s,
    collective_model,
    collective_s,
    matmuls_s,
    predict,
    simulate,
)
from commfuse_compile.options import PROFILE_ENV
from commfuse_compile.passes import match
from commfuse_compile.passes.fx.declines import Declined
from commfuse_compile.passes.plan import MIN_GAIN, auto_choice, plan, site_work
from commfuse_compile.schedules import Direction
from commfuse_compile.tools import calibrate as cal
from commfuse_compile.tools import call_times
from commfuse_compile.tools import profile_fit as fit
from commfuse_compile.tools.sim.layer import write_trace

PROFILES = [pytest.param(p, id=name) for name, p in BUILTIN.items()]
# as calibrated on this project's CI machine (AMX): bfloat16 matmuls and grouped ones
BF16_RATES = {"bfloat16": MatmulRate(3e-5, 1.2e12), "bfloat16 grouped": MatmulRate(6e-5, 1.1e12)}
KINDS = ("gather", "reduce")
GATHER = Direction.GATHER
SIZES = [10.0**e for e in range(14)]  # FLOPs or bytes, 1 to 1e13
DECOMPOSITIONS = ("ring", "bidir", "push", "slicing")


def _ring_terms(work: Work, p: Profile) -> tuple[float, float, float]:
    """SPEC.md's per-step costs: one block's matmuls c, one message m, one add a."""
    calls = work.matmuls_per_block
    c = calls * p.matmul_s(work.block_flops / calls)
    a = p.add_s(work.block_bytes) if work.direction == "reduce" else 0.0
    return c, p.message_s(work.block_bytes), a


def _balanced(kind: str, n: int, p: Profile, block_bytes: float = 64e6) -> Work:
    """A site whose n block matmuls take as long as the ring's n-1 messages."""
    c = (n - 1) * p.message_s(block_bytes) / n
    return Work(kind, n, (c - p.matmul_latency_s) * p.matmul_flops, block_bytes)


def _timeline(end_s: float) -> Timeline:
    return Timeline("any", [Event(0, "compute", 0, "matmul", 0.0, end_s)])


# ----------------------------------------------------------------------------------------
# the simulator


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_predicted_time_never_drops_when_the_matmul_or_the_message_grows(profile, kind, schedule):
    for n in (2, 3, 8):
        for calls in (1, 3):
            for other in (64.0, 1e7):
                by_flops = [Work(kind, n, f, other, calls) for f in SIZES]
                by_bytes = [Work(kind, n, other * 1e3, b, calls) for b in SIZES]
                for works in (by_flops, by_bytes):
                    ends = [simulate(w, schedule, profile, slices=3).end_s for w in works]
                    assert ends == sorted(ends) and ends[-1] > ends[0], (n, calls, other)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("kind", KINDS)
def test_ring_follows_specs_per_step_formula(profile, kind):
    """c + (n-1)(step overhead + max(c, m) + a): every message but the last block's
    matmul is hidden or hides it, and nothing else is exposed (SPEC.md's model: no
    slowdown of a matmul under a transfer)."""
    profile = dataclasses.replace(profile, overlap_slowdown=0.0)
    for n in range(1, 9):
        for flops in (1e3, 1e9, 1e12):
            for nbytes in (64.0, 1e6, 1e9):
                work = Work(kind, n, flops, nbytes, matmuls_per_block=2)
                c, m, a = _ring_terms(work, profile)
                expected = c + (n - 1) * (profile.step_overhead_s + max(c, m) + a)
                got = simulate(work, "ring", profile).end_s
                assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("kind", KINDS)
def test_ring_is_within_one_block_and_the_step_overheads_of_the_lower_bound(profile, kind):
    """What the model promises for overlap: never faster than its matmuls alone or its
    messages alone, never slower than the longer of the two by more than the one block
    matmul that nothing can hide (the first for gather, the last for reduce) plus each
    step's fixed overhead and add. Not "by the step overheads alone": that extra block
    is SPEC.md's "one step that cannot overlap"."""
    o = profile.step_overhead_s
    for n in range(2, 9):
        for flops in SIZES:
            for nbytes in (64.0, 1e5, 1e7, 1e9):
                work = Work(kind, n, flops, nbytes)
                c, m, a = _ring_terms(work, profile)
                matmuls_alone, messages_alone = n * c, (n - 1) * (m + a)
                ring = simulate(work, "ring", profile).end_s
                assert ring >= max(matmuls_alone, messages_alone) * (1 - 1e-12)
                slack = c + (n - 1) * (o + a)
                assert ring <= (max(matmuls_alone, messages_alone) + slack) * (1 + 1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_bidir_is_never_slower_than_ring_on_duplex_links(kind):
    profile = BUILTIN["ascend-910b-hccs"]
    assert profile.duplex_neighbours
    for n in range(2, 9):
        for flops in SIZES:
            for nbytes in (64.0, 1e5, 1e7, 1e9):
                work = Work(kind, n, flops, nbytes)
                bidir = simulate(work, "bidir", profile).end_s
                assert bidir <= simulate(work, "ring", profile).end_s * (1 + 1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_bidir_behind_a_switch_saves_only_the_fixed_costs_of_the_rounds_it_skips(kind):
    """Both neighbours' messages leave through one port: on a link-bound site bidir moves
    the ring's bytes in fewer, longer rounds, and gains at most one step overhead and one
    message latency per round saved (less up to two tiny block matmuls: a step of two
    blocks exposes one more at the start or at the end)."""
    profile = BUILTIN["h100-nvlink4"]
    assert not profile.duplex_neighbours
    for n in range(2, 9):
        work = Work(kind, n, block_flops=1e3, block_bytes=1e9)
        saved = simulate(work, "ring", profile).end_s - simulate(work, "bidir", profile).end_s
        most = ((n - 1) - n // 2) * (profile.step_overhead_s + profile.link_alpha_s)
        assert most - 2 * profile.matmul_s(1e3) <= saved <= most + 1e-12, n


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("kind", KINDS)
def test_slicing_exposes_a_head_or_a_tail_that_ring_does_not(profile, kind):
    n, k = 4, 2
    work = _balanced(kind, n, profile)
    sliced = simulate(work, "slicing", profile, slices=k).on_rank(0)
    ring = simulate(work, "ring", profile).on_rank(0)
    for events, exposed in ((sliced, True), (ring, False)):
        compute = [e for e in events if e.lane == "compute"]
        comm = [e for e in events if e.lane == "comm"]
        if kind == "gather":  # head: nothing to multiply until a first transfer lands
            first_matmul = min(e.start_s for e in compute)
            head = min(e.end_s for e in comm) if exposed else profile.step_overhead_s
            assert first_matmul == pytest.approx(head)
        else:  # tail: a transfer still running after the last matmul and add
            last_compute = max(e.end_s for e in compute)
            assert (max(e.end_s for e in comm) > last_compute) is exposed


@pytest.mark.parametrize("profile", [p for p in PROFILES if not p.values[0].duplex_neighbours])
@pytest.mark.parametrize("kind", KINDS)
def test_slicing_is_no_faster_than_ring_when_comm_matches_compute(profile, kind):
    """With k <= n/2 chunks, slicing's exposed chunk transfer is at least twice the
    ring's exposed block matmul. Not on duplex links: there the collectives of the
    slices use both directions and can beat the one-directional ring."""
    for n in (4, 8):
        work = _balanced(kind, n, profile)
        ring = simulate(work, "ring", profile).end_s
        for k in range(2, n // 2 + 1):
            assert simulate(work, "slicing", profile, slices=k).end_s >= ring, (n, k)


def _chunk_times(work: Work, p: Profile, k: int) -> tuple[float, float]:
    """(a chunk's collective, a chunk's matmuls) in ``work``'s slicing on rank 0."""
    events = simulate(work, "slicing", p, slices=k).on_rank(0)
    comm = {e.end_s - e.start_s for e in events if e.lane == "comm"}
    compute = {e.end_s - e.start_s for e in events if e.lane == "compute"}
    return max(comm), max(compute)


@pytest.mark.parametrize("kind", KINDS)
def test_slicing_pays_each_collectives_start_and_its_stall_under_matmuls(kind):
    """As the lowering runs it, step by step: the compute thread starts a chunk's
    collective (``collective_issue_s``), runs the matmuls under it, then waits for it.
    Compute-bound, each start but the one with nothing to compute under it adds to the
    time and the stall hides under the matmuls; comm-bound, the starts hide under the
    collectives and each collective under matmuls ends the stall later."""
    p = dataclasses.replace(BUILTIN["gloo-loopback"], overlap_slowdown=0.0)
    k = 3
    compute_bound, comm_bound = Work(kind, 4, 1e10, 1e4), Work(kind, 4, 1e6, 1e7)
    for work, hides in ((compute_bound, "stall"), (comm_bound, "start")):
        comm, compute = _chunk_times(work, p, k)
        short = min(comm, compute)
        assert max(comm, compute) >= 4 * short  # bound by one side
        paid = dataclasses.replace(p, collective_issue_s=short / 2, collective_stall_s=short / 2)
        added = simulate(work, "slicing", paid, slices=k).end_s
        added -= simulate(work, "slicing", p, slices=k).end_s
        assert added == pytest.approx((k - 1) * short / 2), hides
        stall_over = dataclasses.replace(paid, collective_stall_s=10 * compute)
        over = simulate(work, "slicing", stall_over, slices=k).end_s
        if hides == "start":  # never later than the matmuls it ran under
            assert over - simulate(work, "slicing", p, slices=k).end_s == pytest.approx(
                (k - 1) * compute
            )


def test_a_sliced_collective_starts_once_the_program_reaches_it():
    """Chunk i+1's all-gather starts only after chunk i's was waited and the matmuls of
    chunk i-1 ran: the compute thread starts it, between the two (not on a comm lane of
    its own, back to back, as the model had it)."""
    p = BUILTIN["gloo-loopback"]
    events = simulate(Work(GATHER, 4, 1e10, 1e4), "slicing", p, slices=3).on_rank(0)
    comm = sorted((e for e in events if e.lane == "comm"), key=lambda e: e.start_s)
    compute = sorted((e for e in events if e.lane == "compute"), key=lambda e: e.start_s)
    for i in range(1, len(comm)):
        assert comm[i].start_s >= max(comm[i - 1].end_s, compute[i - 2].end_s if i > 1 else 0)
        assert comm[i].start_s == pytest.approx(compute[i - 1].start_s)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_lane_runs_one_thing_at_a_time(profile, schedule):
    for kind in KINDS:
        for n in (2, 3, 4, 5, 8):
            for work in (Work(kind, n, 1e6, 1e4, 2), _balanced(kind, n, profile, 1e6)):
                timeline = simulate(work, schedule, profile, slices=3)
                for r in range(n):
                    for lane in ("compute", "comm"):
                        events = sorted(
                            (e for e in timeline.on_rank(r) if e.lane == lane),
                            key=lambda e: e.start_s,
                        )
                        assert all(0 <= e.start_s <= e.end_s for e in events)
                        for before, after in zip(events, events[1:], strict=False):
                            assert after.start_s >= before.end_s, (kind, n, r, lane)


def test_timeline_as_json_is_one_ranks_events_in_microseconds():
    timeline = simulate(Work(Direction.REDUCE, 3, 1e9, 1e6), "ring", BUILTIN["h100-nvlink4"])
    for rank in range(3):
        rows = timeline.as_json(rank)
        events = timeline.on_rank(rank)
        assert len(rows) == len(events) > 0
        for row, event in zip(rows, events, strict=True):
            assert list(row) == ["lane", "step", "name", "start_us", "end_us"]
            assert (row["lane"], row["step"], row["name"]) == (event.lane, event.step, event.name)
            assert row["start_us"] == pytest.approx(event.start_s * 1e6, abs=1e-3)
            assert row["end_us"] == pytest.approx(event.end_s * 1e6, abs=1e-3)
        assert json.loads(json.dumps(rows)) == rows
    assert {row["lane"] for row in timeline.as_json(0)} == {"compute", "comm"}


def test_chrome_trace_is_trace_event_json(tmp_path):
    profile = BUILTIN["gloo-loopback"]
    work = Work(Direction.GATHER, 3, 1e8, 1e5)
    timelines = [(s, simulate(work, s, profile)) for s in ("collective", "bidir")]
    path = tmp_path / "trace.json"
    write_trace(timelines, path)
    trace_events = json.loads(path.read_text())["traceEvents"]
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in trace_events
        if e["name"] in ("process_name", "thread_name")
    }
    slices = [e for e in trace_events if e["ph"] == "X"]
    assert len(slices) == sum(len(t.events) for _, t in timelines)
    for e in slices:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int)
        assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["args"]["step"], int)
        assert names[e["pid"], e["tid"]] in ("compute", "comm")  # a named thread per lane
        assert names[e["pid"], None].endswith(f"rank {e['pid'] % 1000}")
    assert {"collective rank 0", "bidir rank 2"} <= set(names.values())


# ----------------------------------------------------------------------------------------
# the choice


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_collective_is_kept_for_a_tiny_matmul(profile, kind, n):
    """A 2x8 @ 8x8 float32 block: nothing to hide a message behind, so every extra step
    only adds its overhead (bidir's fewer rounds are no gain either: the collective is
    credited with the same bidirectional algorithm)."""
    work = Work(kind, n, block_flops=2 * 2 * 8 * 8, block_bytes=2 * 8 * 4)
    with pytest.raises(Declined, match="^not profitable: "):
        plan(predict(work, profile), Options(), work.direction)


@pytest.mark.parametrize("kind", KINDS)
def test_a_decomposition_is_chosen_for_a_llama3_8b_mlp_on_8_h100(kind):
    """Llama-3 8B's MLP at 8192 tokens, tensor parallel over 8 GPUs, bf16: gate+up
    (all-gather -> [8192, 4096] @ [4096, 2 x 14336 / 8]) and down ([8192, 14336 / 8] @
    [14336 / 8, 4096] -> reduce-scatter). Each block's matmul (~50 us) outweighs its
    message (~33 us) and the 10 us step overhead, so hiding the messages pays."""
    tokens, hidden, ffn, n = 8192, 4096, 14336, 8
    if kind == "gather":
        flops, nbytes = 2 * tokens * hidden * (2 * ffn // n), tokens // n * hidden * 2
    else:
        flops, nbytes = 2 * tokens * (ffn // n) * hidden, tokens // n * hidden * 2
    profile = BUILTIN["h100-nvlink4"]
    predicted = predict(Work(kind, n, flops / n, nbytes), profile)
    chosen = plan(predicted, Options(), Direction(kind))
    times = {s: t.end_s for s, t in predicted.items()}
    assert chosen.schedule == min(times, key=times.__getitem__) != "collective"
    assert times[chosen.schedule] * 1.2 < times["collective"]
    assert chosen.why.startswith(f"{chosen.schedule} predicted")
    # ... and it is the overlap that pays: more of the ring's time is spent computing
    collective, ring = predicted["collective"], predicted["ring"]
    assert ring.exposed_comm_s() < collective.exposed_comm_s() / 2


def test_auto_keeps_the_collective_unless_the_gain_is_worth_the_risk():
    options = Options()
    near = {"collective": _timeline(1.0), "ring": _timeline(1.0 / MIN_GAIN * 1.001)}
    with pytest.raises(Declined, match="must gain 5%"):
        plan(near, options, GATHER)
    clear = {"collective": _timeline(1.0), "ring": _timeline(0.5), "bidir": _timeline(0.6)}
    assert plan(clear, options, GATHER).schedule == "ring"
    assert plan(clear, options, GATHER).why == "ring predicted 2.00x faster"


def test_auto_skips_disabled_schedules_and_a_requested_schedule_is_taken_as_is():
    predicted = {"collective": _timeline(1.0), "ring": _timeline(0.5), "bidir": _timeline(0.6)}
    assert plan(predicted, Options(disable=frozenset({"ring"})), GATHER).schedule == "bidir"
    with pytest.raises(Declined, match="every schedule is disabled"):
        plan(
            {"collective": _timeline(1.0), "ring": _timeline(0.5)},
            Options(disable=frozenset({"ring"})),
            GATHER,
        )
    assert (
        plan(predicted, Options(schedule="bidir"), GATHER).schedule == "bidir"
    )  # slower, asked for
    with pytest.raises(Declined, match="schedule 'ring' is disabled"):
        plan(predicted, Options(schedule="ring", disable=frozenset({"ring"})), GATHER)
    with pytest.raises(Declined, match="schedule 'off'"):
        plan(predicted, Options(schedule="off"), GATHER)


@pytest.fixture
def fake_world_of_4():
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    yield
    dist.destroy_process_group()


def test_site_work_counts_a_sites_flops_bytes_and_matmul_calls(fake_world_of_4):
    """Two matmuls reading one gathered [16, 8] float32 tensor (with [8, 6] and [8, 7]
    weights, which every block's matmul reads whole); a [16, 8] @ [8, 6] product
    reduce-scattered over 4 ranks."""
    gather = AgMm(shard=(4, 8), dim=0, n_out=6, consumers=2, bias=False)
    (site,) = match.find_sites(trace(gather, 4, gather.inputs(1, seed=0, n=4)).graph)
    flops, weights = (2 * 16 * 8 * (6 + 7)) / 4, 4 * 8 * (6 + 7)
    products = 16 * (6 + 7) * 4  # the rows of both products, concatenated
    expected = Work(
        GATHER, 4, flops, 4 * 8 * 4, 2, whole_bytes=weights, matmul_class="float32",
        product_bytes=products,
    )  # fmt: skip
    assert site_work(site, 4) == expected
    # Inductor has each block's matmul write into its slice of the concatenation
    assert site_work(site, 4, "inductor") == dataclasses.replace(expected, product_bytes=0.0)
    bf16 = [t.to(torch.bfloat16) for t in gather.inputs(1, seed=0, n=4)]
    (site,) = match.find_sites(trace(gather, 4, bf16).graph)
    assert site_work(site, 4) == dataclasses.replace(
        expected,
        block_bytes=4 * 8 * 2,
        whole_bytes=weights / 2,
        matmul_class="bfloat16",
        product_bytes=products / 2,
    )
    reduce = MmRs(lead=(2, 8), k=8, n_out=6, dim=1, bias=False)
    (site,) = match.find_sites(trace(reduce, 4, reduce.inputs(1, seed=0)).graph)
    flops, weight = (2 * 16 * 6 * 8) / 4, 4 * 8 * 6
    assert site_work(site, 4) == Work(
        Direction.REDUCE, 4, flops, 16 * 6 * 4 / 4, 1, whole_bytes=weight, matmul_class="float32"
    )


def _projections_gathering_each(x, wq, wk, wv):
    """q, k and v as DTensor's sequence parallelism traces them: each linear gathers its
    input itself, three all-gathers of one shard."""
    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name

    def gathered():
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, 4, group))

    return torch.mm(gathered(), wq), torch.mm(gathered(), wk), torch.mm(gathered(), wv)


def test_a_site_kept_as_written_pays_each_of_its_gathers(fake_world_of_4):
    """The program as written gathers the shard once per linear that reads it; the
    rewrite runs one ring for all three. Kept, the site is priced at its three calls,
    one after the other (stop 62: ``auto`` priced one and kept the quick bench block's
    q/k/v and w1/w3 gathers, 9 all-gathers a step where the ring ran 6 transfers, and
    its step ran 100.1 ms against the ring's 87.4)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = [torch.randn(4, 8)] + [torch.randn(8, 6) for _ in range(3)]
    gm = make_fx(_projections_gathering_each, tracing_mode="fake")(*inputs)
    (site,) = match.find_sites(gm.graph)
    work = site_work(site, 4)
    assert work.written_calls == 3 and work.matmuls_per_block == 3
    p = BUILTIN["gloo-loopback"]
    once = dataclasses.replace(work, written_calls=1)
    gathers = simulate(work, "collective", p).end_s - simulate(once, "collective", p).end_s
    assert gathers == pytest.approx(2 * collective_s(work, p))
    for schedule in DECOMPOSITIONS:  # one ring (or one sliced gather) for all three
        assert simulate(work, schedule, p).end_s == simulate(once, schedule, p).end_s


def test_a_matmul_runs_at_its_class_rate_and_an_op_call_costs_its_own():
    """bfloat16 on this project's CI machine: 4-7x float32's FLOP/s, 30 us a call."""
    p = dataclasses.replace(BUILTIN["gloo-loopback"], matmul_rates=BF16_RATES)
    assert p.matmul_s(1e9, 0.0, "bfloat16") == pytest.approx(3e-5 + 1e9 / 1.2e12)
    assert p.matmul_s(1e9, 0.0, "bfloat16 grouped") == pytest.approx(6e-5 + 1e9 / 1.1e12)
    assert p.matmul_rate("bfloat16 batched") == BF16_RATES["bfloat16"]
    for other in ("float32", "float16", None):
        assert p.matmul_s(1e9, 0.0, other) == BUILTIN["gloo-loopback"].matmul_s(1e9)
    assert p.memory_op_s(0.0) == p.matmul_latency_s  # an op's call: a matmul's, unmeasured
    assert dataclasses.replace(p, op_call_s=1.2e-5).memory_op_s(0.0) == 1.2e-5
    work = Work(GATHER, 2, 1e9, 1e6, matmul_class="bfloat16")
    assert (
        simulate(work, "ring", p).end_s
        < simulate(dataclasses.replace(work, matmul_class=None), "ring", p).end_s
    )


# ----------------------------------------------------------------------------------------
# profiles and options


@pytest.mark.parametrize("profile", PROFILES)
def test_profiles_round_trip_through_a_file(profile, tmp_path):
    path = tmp_path / "p.json"
    save(profile, path)
    assert load(path) == profile == load(profile.name)
    duplex = dataclasses.replace(profile, name="mine", duplex_neighbours=True)
    save(duplex, path)
    assert load(str(path)) == duplex
    rated = dataclasses.replace(profile, name="rated", matmul_rates=BF16_RATES)
    save(rated, path)
    assert load(str(path)) == rated


@pytest.mark.parametrize("name", BUILTIN)
def test_option_profile_takes_a_builtin_name(name):
    assert Options.from_mapping({"profile": name}).profile == name


def test_option_profile_takes_a_file(tmp_path):
    path = tmp_path / "calibrated.json"
    save(dataclasses.replace(BUILTIN["gloo-loopback"], name="calibrated"), path)
    assert Options.from_mapping({"profile": path}).profile == str(path)


def _write(path, text):
    path.write_text(text)
    return path


def _with_rates(tmp, rates):
    fields = BUILTIN["gloo-loopback"].as_json() | {"matmul_rates": rates}
    return _write(tmp / "p.json", json.dumps(fields))


BAD_PROFILES = [
    pytest.param(
        lambda tmp: _with_rates(tmp, {"bfloat16": {"latency_s": 3e-5}}),
        r"matmul_rates bfloat16: fields missing \['flops'\]",
        id="rate-without-flops",
    ),
    pytest.param(
        lambda tmp: _with_rates(tmp, {"bfloat16": {"latency_s": 3e-5, "flops": 0}}),
        "matmul_rates bfloat16: flops must be positive",
        id="rate-of-zero",
    ),
    pytest.param(
        lambda tmp: _with_rates(tmp, [1e12]), "matmul_rates must be an object", id="rates-list"
    ),
    pytest.param(lambda tmp: tmp / "missing.json", "neither a built-in", id="missing"),
    pytest.param(lambda tmp: tmp, "neither a built-in", id="directory"),
    pytest.param(lambda tmp: _write(tmp / "p.json", "{not json"), "is not JSON", id="garbage"),
    pytest.param(
        lambda tmp: _write(tmp / "p.json", "[1, 2]"), "must hold a JSON object, got list", id="list"
    ),
    pytest.param(
        lambda tmp: _write(tmp / "p.json", '{"name": "x"}'),
        r"fields missing \['source', 'matmul_flops', .*'collective_overhead_s'\]",
        id="missing-fields",
    ),
    pytest.param(
        lambda tmp: _write(
            tmp / "p.json", json.dumps(BUILTIN["gloo-loopback"].as_json() | {"colour": 1})
        ),
        r"fields unknown \['colour'\]",
        id="unknown-field",
    ),
    pytest.param(
        lambda tmp: _write(
            tmp / "p.json",
            json.dumps(
                BUILTIN["gloo-loopback"].as_json()
                | {"collectives": {"all_gather": {"2": {"latency_s": 1e-4}}}}
            ),
        ),
        "collectives all_gather 2: needs latency_s, seconds_per_byte and points",
        id="bad-curve",
    ),
    pytest.param(
        lambda tmp: _write(
            tmp / "p.json",
            json.dumps(BUILTIN["gloo-loopback"].as_json() | {"link_bytes_per_s": "fast"}),
        ),
        "link_bytes_per_s must be a finite number",
        id="string-rate",
    ),
    pytest.param(
        lambda tmp: _write(
            tmp / "p.json",
            json.dumps(BUILTIN["gloo-loopback"].as_json() | {"matmul_flops": 0}),
        ),
        "matmul_flops must be positive",
        id="zero-rate",
    ),
    pytest.param(
        lambda tmp: _write(
            tmp / "p.json",
            json.dumps(BUILTIN["gloo-loopback"].as_json() | {"step_overhead_s": -1e-3}),
        ),
        "step_overhead_s must not be negative",
        id="negative-overhead",
    ),
]


@pytest.mark.parametrize(("make", "error"), BAD_PROFILES)
def test_option_profile_rejects_what_is_not_a_profile(make, error, tmp_path):
    path = make(tmp_path)
    with pytest.raises(ProfileError, match=error):
        load(path)
    with pytest.raises(CommfuseOptionError, match=f"option 'profile': .*{error}"):
        Options.from_mapping({"profile": str(path)})


def test_option_profile_rejects_a_value_that_is_no_path():
    with pytest.raises(CommfuseOptionError, match="option 'profile' must be"):
        Options.from_mapping({"profile": 3})


def test_option_profile_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(PROFILE_ENV, "a100-nvlink3")
    assert Options.from_mapping({}).profile == "a100-nvlink3"
    assert Options.from_mapping({"profile": "h100-nvlink4"}).profile == "h100-nvlink4"
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(CommfuseOptionError, match="option 'profile'"):
        Options.from_mapping({})


@pytest.mark.parametrize("slices", [2, 7, 64])
def test_option_slices_accepts_a_chunk_count(slices):
    assert Options.from_mapping({"slices": slices}).slices == slices


@pytest.mark.parametrize("slices", [1, 0, -2, 65, "2", 2.0, True, None])
def test_option_slices_rejects_anything_else(slices):
    with pytest.raises(CommfuseOptionError, match="option 'slices' must be an integer in 2..64"):
        Options.from_mapping({"slices": slices})


# ----------------------------------------------------------------------------------------
# calibration


def test_fit_line_recovers_a_line_and_keeps_both_terms_non_negative():
    a, b = fit.fit_line([(x, 3e-5 + x * 2e-9) for x in (1e3, 1e5, 1e6, 1e8)])
    assert (a, b) == (pytest.approx(3e-5, rel=1e-9), pytest.approx(2e-9, rel=1e-9))
    a, _ = fit.fit_line([(x, -1e-3 + x * 1e-6) for x in (1e4, 1e5, 1e6)])
    assert a == 0.0
    _, b = fit.fit_line([(x, 1e-3 - x * 1e-9) for x in (1e3, 1e4, 1e5)])
    assert 0 < b < 1e-20


DIRECTION_OF = {
    "all_gather": "gather",
    "reduce_scatter": "reduce",
    "all_to_all": "exchange_in",
    "all_reduce": "reduce",  # then gathered: an ``mm_ar`` site's collective
}


def _collective_s(p: Profile, kind: str, g: int, block_bytes: float) -> float:
    work = Work(DIRECTION_OF[kind], g, 0.0, block_bytes, then_gather=kind == "all_reduce")
    return simulate(work, "collective", p).end_s


def _measurements_of(p: Profile, n: int) -> fit.Measurements:
    """What ``calibrate.measure`` would return on a machine that is exactly ``p`` (its
    collectives run as the ring formula says, each call as timed: the sliced site's
    chunk collectives too)."""
    site = fit.gather_site_work(fit.STEP_SITE, n)
    collectives = {
        kind: {
            g: [(float(b), _collective_s(p, kind, g, b)) for b in cal.CURVE_BLOCK_BYTES]
            for g in range(2, n + 1)
        }
        for kind in COLLECTIVES
    }
    as_timed = dataclasses.replace(p, collectives=fit.fitted_curves(collectives))
    gather = as_timed.curve("all_gather", n)
    shape = fit.sliced_site_shape(gather, p.matmul_latency_s, p.matmul_flops, n)
    sliced = fit.gather_site_work(shape, n)
    return fit.Measurements(
        matmul=[(2.0 * a * b * c, p.matmul_s(2.0 * a * b * c)) for a, b, c in cal.MATMUL_SHAPES],
        skinny=[
            (2.0 * a * b * c, 4.0 * b * c, p.matmul_s(2.0 * a * b * c, 4.0 * b * c))
            for a, b, c in cal.SKINNY_SHAPES
        ],
        message=[(float(size), p.message_s(size)) for size in cal.MESSAGE_BYTES],
        add_bytes_per_s=p.memory_bytes_per_s,
        collectives=collectives,
        fixed=fit.FixedCostProbe(
            ring_site_s=simulate(site, "ring", p).end_s,
            collective_site_s=simulate(site, "collective", p).end_s,
            overlap_slowdown=p.overlap_slowdown,
        ),
        rated={
            rate_class: [
                (2.0 * a * b * c, p.matmul_s(2.0 * a * b * c, 0.0, rate_class))
                for a, b, c in cal.MATMUL_SHAPES
            ]
            for rate_class in p.matmul_rates
        },
        op_call_s=p.op_call_s,
        sliced=fit.SlicedProbe(
            shape=shape,
            site_s=simulate(sliced, "slicing", as_timed, fit.SLICED_SITE_CHUNKS).end_s,
            matmul_s=matmuls_s(sliced, p),
            issue_s=p.collective_issue_s,
        ),
    )


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_profile_from_reproduces_the_constants_it_was_measured_on(profile, n):
    """Duplex links are not measured (two ranks cannot tell): a duplex profile comes back
    as a switched one, with the same constants. The machine's collectives run as the ring
    formula says (its call overhead is then what the step site shows). A collective's
    start and its stall come back from the sliced site (the stall where the site's
    matmuls outlast it)."""
    profile = dataclasses.replace(
        profile, duplex_neighbours=False, collectives={}, matmul_rates=BF16_RATES, op_call_s=1.2e-5
    )
    # a skinny matmul's weight read left out: the site's K and N are chosen by the line
    profile = dataclasses.replace(profile, matmul_bytes_per_s=0.0)
    sliced = fit.gather_site_work(_measurements_of(profile, n).sliced.shape, n)
    short = min(_chunk_times(sliced, profile, 2))
    profile = dataclasses.replace(
        profile, collective_issue_s=short / 10, collective_stall_s=short / 3
    )
    fitted = fit.profile_from(_measurements_of(profile, n), n, "fitted", "synthetic")
    for rate_class, rate in BF16_RATES.items():
        assert dataclasses.astuple(fitted.matmul_rates[rate_class]) == pytest.approx(
            dataclasses.astuple(rate), rel=1e-6
        )
    assert (fitted.name, fitted.source, fitted.duplex_neighbours) == ("fitted", "synthetic", False)
    for field in dataclasses.fields(Profile):
        value = getattr(profile, field.name)
        if isinstance(value, float):
            assert getattr(fitted, field.name) == pytest.approx(value, rel=1e-6), field.name
    for kind in COLLECTIVES:  # the measured curves time the collective as measured
        for g in range(2, n + 1):
            for nbytes in cal.CURVE_BLOCK_BYTES:
                expected = _collective_s(profile, kind, g, nbytes)
                assert fitted.curve(kind, g).seconds(nbytes) == pytest.approx(expected, rel=1e-6)


def test_a_measured_collective_between_computations_costs_what_the_step_site_shows():
    """A machine whose collective, called between computations, takes 0.4 ms more than
    its calls timed back to back (its curves): the step site as written shows it, and
    the fitted profile gives every measured collective it (``collective_resume_s``, at the
    compute speed's factor too) and the ring formula's collectives, fitted on the same
    site, their overhead with it."""
    p, n, resume = dataclasses.replace(BUILTIN["gloo-loopback"], collectives={}), 2, 4e-4
    m, site = _measurements_of(p, n), fit.gather_site_work(fit.STEP_SITE, n)
    as_timed = dataclasses.replace(p, collectives=fit.fitted_curves(m.collectives))
    back_to_back = simulate(site, "collective", as_timed).end_s
    before, fitted = (
        fit.profile_from(
            dataclasses.replace(
                m, fixed=dataclasses.replace(m.fixed, collective_site_s=back_to_back + extra)
            ),
            n,
            "fitted",
            "synthetic",
        )
        for extra in (0.0, resume)
    )
    assert before.collective_resume_s == pytest.approx(0.0, abs=1e-12)
    assert fitted.collective_resume_s == pytest.approx(resume, rel=1e-6)
    assert fitted.collective_overhead_s == pytest.approx(before.collective_overhead_s + resume)
    assert simulate(site, "collective", fitted).end_s == pytest.approx(back_to_back + resume)
    decode = Work(Direction.REDUCE, n, 0.0, 8192.0, then_gather=True)  # a decode all-reduce
    measured = fitted.curve("all_reduce", n).seconds(8192.0)
    assert collective_call_s(decode, fitted) == pytest.approx(measured + resume)
    assert at_compute_speed(fitted, 2.0).collective_resume_s == pytest.approx(2 * resume)
    # a site as written pays it once per call of its collective, a profile without it none
    assert simulate(site, "collective", fitted).end_s - simulate(
        site, "collective", dataclasses.replace(fitted, collective_resume_s=0.0)
    ).end_s == pytest.approx(resume)


def test_a_sliced_site_slower_than_any_stall_gives_the_least_stall_that_explains_most():
    """A sliced probe a second slower than its simulation: no stall explains that (the
    model stalls a collective at most the matmuls' time under it), and the fit is the
    least stall that reaches the most the model can show, not a second."""
    p, n = dataclasses.replace(BUILTIN["gloo-loopback"], collectives={}), 2
    m = _measurements_of(p, n)
    slow = dataclasses.replace(m, sliced=dataclasses.replace(m.sliced, site_s=m.sliced.site_s + 1))
    stall = fit.profile_from(slow, n, "fitted", "synthetic").collective_stall_s
    site = fit.gather_site_work(m.sliced.shape, n)
    fitted = fit.profile_from(m, n, "fitted", "synthetic")
    at_speed = dataclasses.replace(
        at_compute_speed(fitted, m.sliced.matmul_s / matmuls_s(site, fitted)),
        collective_issue_s=m.sliced.issue_s,
    )

    def sliced_s(stall_s: float) -> float:
        with_stall = dataclasses.replace(at_speed, collective_stall_s=stall_s)
        return simulate(site, "slicing", with_stall, fit.SLICED_SITE_CHUNKS).end_s

    assert 0 < stall < 1
    assert sliced_s(stall) == pytest.approx(sliced_s(math.inf))
    assert sliced_s(0.9 * stall) < sliced_s(stall)


# ----------------------------------------------------------------------------------------
# the collective as the backend runs it, and the matmul slowed by a transfer


def test_collective_is_timed_by_its_measured_curve_where_the_profile_has_one():
    p = dataclasses.replace(
        BUILTIN["gloo-loopback"],
        collectives={"reduce_scatter": {2: Curve(latency_s=1e-3, seconds_per_byte=2e-9)}},
    )
    work = Work(Direction.REDUCE, 2, block_flops=0.0, block_bytes=1e6)
    assert simulate(work, "collective", p).end_s == pytest.approx(1e-3 + 2e-3 + p.matmul_s(0.0))
    assert collective_model(work, p) == "reduce_scatter as measured on 2 ranks (gloo-loopback)"
    on_four = dataclasses.replace(work, n=4)
    ring_formula = simulate(on_four, "collective", dataclasses.replace(p, collectives={}))
    assert simulate(on_four, "collective", p).end_s == ring_formula.end_s
    assert collective_model(on_four, p).startswith("ring formula: gloo-loopback has no measured")


def test_a_profile_file_without_curves_still_loads(tmp_path):
    """Files written before the curves existed: the model falls back to the ring formula
    (and the report says so, ``collective_model``)."""
    fields = BUILTIN["gloo-loopback"].as_json()
    del fields["collectives"], fields["overlap_slowdown"]
    path = _write(tmp_path / "old.json", json.dumps(fields))
    assert load(path).collectives == {} and load(path).overlap_slowdown == 0.0


A2A_CURVE = Curve(latency_s=1e-3, seconds_per_byte=4e-9, points=((4096.0, 1.02e-3), (1e6, 5e-3)))


@pytest.mark.parametrize("direction", ["exchange_in", "exchange_out"])
def test_an_all_to_all_is_timed_by_its_measured_curve_either_way(direction, tmp_path):
    """gloo's all_to_all_single takes about twice the ring's time for its bytes: where the
    profile (a file written by ``calibrate``) has the curve, the baseline of an
    all-to-all site is what the curve says, on its group size only."""
    base = BUILTIN["gloo-loopback"]
    path = tmp_path / "a2a.json"
    save(
        dataclasses.replace(base, collectives=base.collectives | {"all_to_all": {2: A2A_CURVE}}),
        path,
    )
    p = load(path)
    assert p.curve("all_to_all", 2) == A2A_CURVE
    work = Work(direction, 2, block_flops=0.0, block_bytes=1e6)
    assert simulate(work, "collective", p).end_s == pytest.approx(1e-3 + 4e-3 + p.matmul_s(0.0))
    assert simulate(work, "collective", base).end_s < 0.7 * simulate(work, "collective", p).end_s
    assert collective_model(work, p) == "all_to_all as measured on 2 ranks (gloo-loopback)"
    # the decomposition's steps are P2P messages: the curve does not touch them
    assert simulate(work, "ring", p).end_s == simulate(work, "ring", base).end_s
    on_four = dataclasses.replace(work, n=4)
    assert simulate(on_four, "collective", p).end_s == simulate(on_four, "collective", base).end_s


def test_a_profile_file_without_the_all_to_all_curve_still_loads_and_uses_the_formula(tmp_path):
    """Files calibrated before the all-to-all was measured: their all-gather and
    reduce-scatter curves load and are used, the all-to-all falls back to the ring formula
    (pairwise messages plus the call overhead), and ``collective_model`` says why."""
    fields = BUILTIN["gloo-loopback"].as_json()
    assert set(fields["collectives"]) == {"all_gather", "reduce_scatter"}
    p = load(_write(tmp_path / "old.json", json.dumps(fields)))
    assert p == BUILTIN["gloo-loopback"] and p.curve("all_to_all", 2) is None
    work = Work(Direction.EXCHANGE_OUT, 2, block_flops=0.0, block_bytes=1e6)
    formula = p.collective_overhead_s + p.message_s(1e6)  # one pairwise step on 2 ranks
    assert simulate(work, "collective", p).end_s == pytest.approx(formula + p.matmul_s(0.0))
    model = collective_model(work, p)
    assert model.startswith("ring formula: gloo-loopback has no measured all_to_all curve")
    assert "calibrated before `commfuse calibrate` measured it" in model
    no_curves = dataclasses.replace(p, collectives={})  # no curve of any kind: no such hint
    assert collective_model(work, no_curves) == (
        "ring formula: gloo-loopback has no measured all_to_all curve for 2 ranks"
    )


def test_a_bad_all_to_all_curve_is_rejected(tmp_path):
    fields = BUILTIN["gloo-loopback"].as_json()
    fields["collectives"]["all_to_all"] = {
        "2": {"latency_s": -1.0, "seconds_per_byte": 1e-9, "points": []}
    }
    with pytest.raises(
        ProfileError, match="collectives all_to_all 2 latency_s must not be negative"
    ):
        load(_write(tmp_path / "bad.json", json.dumps(fields)))
    fields["collectives"] = {"all_to_all_v": {}}
    with pytest.raises(
        ProfileError,
        match=r"collectives are \['all_gather', 'reduce_scatter', 'all_to_all', 'all_reduce'\]",
    ):
        load(_write(tmp_path / "bad.json", json.dumps(fields)))


def test_a_transfer_slows_the_matmul_it_overlaps_by_the_profiles_slowdown():
    base = dataclasses.replace(
        BUILTIN["gloo-loopback"], matmul_latency_s=0.0, step_overhead_s=0.0, link_alpha_s=0.0
    )
    slowed = dataclasses.replace(base, overlap_slowdown=0.5)
    work = Work(
        Direction.GATHER, 2, block_flops=base.matmul_flops * 1e-3, block_bytes=1e9
    )  # m >> c
    plain, busy = (simulate(work, "ring", p) for p in (base, slowed))
    durations = [e.end_s - e.start_s for e in busy.on_rank(0) if e.lane == "compute"]
    assert durations == pytest.approx([1.5e-3, 1e-3])  # the last block has no transfer left
    assert busy.end_s == pytest.approx(plain.end_s)  # hidden under the transfer all the same
    # the collective overlaps nothing: no slowdown
    assert simulate(work, "collective", slowed).end_s == simulate(work, "collective", base).end_s


def test_an_all_reduce_is_timed_as_one_call_where_the_profile_measured_it():
    """An ``mm_ar`` site's collective (its reduced blocks then gathered) is gloo's one
    all-reduce call where the profile has its curve; else a reduce-scatter then an
    all-gather. The schedules' all-gather after their reduce is timed as before."""
    p = BUILTIN["gloo-loopback"]
    work = Work(Direction.REDUCE, 2, 1e6, 1e5, then_gather=True)
    split = simulate(work, "collective", p)
    assert [e.name for e in split.on_rank(0) if e.lane == "comm"] == [
        "reduce_scatter",
        "all_gather",
    ]
    curve = Curve(1e-4, 1e-9)
    measured = dataclasses.replace(p, collectives={**p.collectives, "all_reduce": {2: curve}})
    one = simulate(work, "collective", measured)
    assert [e.name for e in one.on_rank(0) if e.lane == "comm"] == ["all_reduce"]
    assert one.end_s == pytest.approx(p.matmul_s(2e6) + curve.seconds(1e5))
    assert collective_model(work, measured) == "all_reduce as measured on 2 ranks (gloo-loopback)"
    ring = simulate(work, "ring", measured)
    assert ring.end_s == simulate(work, "ring", p).end_s


def test_auto_takes_the_fewest_calls_among_near_ties():
    """Within MIN_GAIN of the fastest, the schedule with the fewest communication calls
    (a call's fixed cost is what the model knows worst); beyond it, the fastest; and
    nothing that does not pay against the collective."""
    times = {"collective": 10.0, "ring": 5.0, "slicing": 4.9}
    calls = {"collective": 1, "ring": 1, "slicing": 2}
    assert auto_choice(times, calls) == "ring"
    assert auto_choice(times) == "slicing"  # no calls known: the fastest
    assert auto_choice({**times, "slicing": 4.0}, calls) == "slicing"  # 25 % faster
    assert auto_choice({"collective": 5.1, "ring": 5.0}, calls) == "collective"
    assert auto_choice({"collective": 0.0, "ring": 0.0}, calls) == "collective"


def test_a_matmul_cut_into_blocks_reads_its_weight_once_per_block():
    """A decode step's product (4 rows per rank) cut into n blocks: each block's matmul
    reads the whole weight again, so the ring's matmuls take n - 1 weight reads more
    than the collective's one call; a skinny shape's cost is mostly that read."""
    p = dataclasses.replace(BUILTIN["gloo-loopback"], overlap_slowdown=0.0)
    n, weight = 4, 4.0 * 1024 * 1024
    work = Work(Direction.REDUCE, n, 2.0 * 1 * 1024 * 1024, 4.0 * 1024, whole_bytes=weight)
    read = weight / p.matmul_bytes_per_s
    assert p.matmul_s(0.0, weight) - p.matmul_s(0.0) == pytest.approx(read)
    assert matmuls_s(work, p) == pytest.approx(p.matmul_s(n * work.block_flops) + read)

    def compute(schedule: str, w: Work) -> float:
        timeline = simulate(w, schedule, p)
        return sum(
            e.end_s - e.start_s for e in timeline.events if e.rank == 0 and "matmul" in e.name
        )

    unread = dataclasses.replace(work, whole_bytes=0.0)
    assert compute("ring", work) - compute("ring", unread) == pytest.approx(n * read)
    assert compute("collective", work) - compute("collective", unread) == pytest.approx(read)
    assert read > 2 * (p.matmul_s(work.block_flops) - p.matmul_latency_s)  # mostly the read


@pytest.mark.parametrize("profile", PROFILES)
def test_a_round_trips_row_ops_cost_their_bytes_on_every_block(profile):
    """A dropless MoE's sorting, element-wise and put-back ops (``Work.block_op_bytes``)
    cost their bytes at the element-wise rate: once over all n blocks in the collective
    (between its all-to-alls), and on each block the round trip runs."""
    work = Work(Direction.ROUND_TRIP, 4, 1e8, 1e6, 2, block_ops=11)
    moved = dataclasses.replace(work, block_op_bytes=5e6)
    extra = 4 * 5e6 / profile.memory_bytes_per_s
    before, after = predict(work, profile), predict(moved, profile)
    assert after["collective"].end_s == pytest.approx(before["collective"].end_s + extra)
    assert after["round_trip"].end_s > before["round_trip"].end_s
    assert after["round_trip"].end_s <= before["round_trip"].end_s + extra * (1 + 1e-9)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("direction", [GATHER, Direction.EXCHANGE_IN])
def test_a_gathers_rewrite_pays_one_copy_of_what_it_concatenates(profile, direction):
    """``Work.product_bytes`` and ``rebuilt_bytes`` (the products' blocks, and the
    collected tensor where the program reads it after the site): every decomposed schedule
    copies them once on each rank after its last block (read and written), the collective
    never (it writes them in place)."""
    work = Work(direction, 4, 1e8, 1e6, 2)
    cat = dataclasses.replace(work, product_bytes=2e6, rebuilt_bytes=1e6)
    before, after = predict(work, profile, slices=2), predict(cat, profile, slices=2)
    assert after["collective"] == before["collective"]
    copy = profile.memory_op_s(2 * 3e6)
    for schedule in set(before) - {"collective"}:
        assert after[schedule].end_s == pytest.approx(before[schedule].end_s + copy)
        for r in range(4):
            last = after[schedule].on_rank(r)[-1]
            assert last.name == "concatenate the blocks"
            assert last.start_s == pytest.approx(max(e.end_s for e in before[schedule].on_rank(r)))


def test_a_curves_calls_are_spread_over_rounds_of_every_point(monkeypatch):
    """``calibrate.collective_curves`` times each (collective, size) in
    ``CURVE_ROUNDS`` rounds that each visit every point once, its calls split among them
    and warmed up once; a point's time is the median of all its calls. A slow spell then
    lands on a few calls of many points: here every call of one round is 100x slower,
    and no point moves. Rank 0 of 2 on the fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    order: list[tuple[str, int, int, bool]] = []

    def timed(collective, nbytes, g, group, calls, warm_up=True):
        order.append((collective, nbytes, calls, warm_up))
        slow = 100.0 if len(order) <= len(COLLECTIVES) * len(cal.CURVE_BLOCK_BYTES) else 1.0
        return [slow * nbytes * 1e-9] * calls

    monkeypatch.setattr(cal, "_collective_times", timed)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        curves, _ = cal.collective_curves(0, cal.one_ring(2), reps=5)
    finally:
        dist.destroy_process_group()
    points = [(c, b) for c in COLLECTIVES for b in cal.CURVE_BLOCK_BYTES]
    assert [(c, b) for c, b, _, _ in order] == points * call_times.CURVE_ROUNDS
    assert [w for *_, w in order] == [True] * len(points) + [False] * (len(order) - len(points))
    assert [calls for _, _, calls, _ in order] == [
        -(-cal._reps(b, 5) // call_times.CURVE_ROUNDS) for _, b in points * call_times.CURVE_ROUNDS
    ]
    for collective in COLLECTIVES:
        assert curves[collective][2] == [(float(b), b * 1e-9) for b in cal.CURVE_BLOCK_BYTES]


def _slowest_rank_of(rank: int, n: int) -> dict[tuple[str, int], list[float]]:
    """Job: ``call_times.slowest_rank`` of call times that differ by rank (rank r's call
    i takes (i + 1) x (r + 1) ms on the first point, 10 - r ms on the other's 5 calls)."""
    times = {
        ("all_to_all", 1): [(i + 1) * (rank + 1) * 1e-3 for i in range(3)],
        ("all_gather", 2): [(10 - rank) * 1e-3] * 5,
    }
    return {
        key: call_times.slowest_rank(seconds, dist.group.WORLD) for key, seconds in times.items()
    }


def test_a_curves_call_is_timed_at_its_slowest_rank(ranks):
    """A collective's point is each call at the rank of the group that took longest (a
    collective is done when its last rank is): every rank gets the same calls, of every
    point, whatever their counts."""
    for slowest in ranks(3).run(_slowest_rank_of):
        assert slowest == {
            ("all_to_all", 1): pytest.approx([3e-3, 6e-3, 9e-3]),
            ("all_gather", 2): pytest.approx([10e-3] * 5),
        }


def _collective_times_of(rank: int, n: int) -> list[float]:
    """Job: ``calibrate._collective_times`` of the smallest all-reduce on the whole group,
    as ``probe_fixed_costs``' small calls time it, its calls' times rank-dependent: rank
    r's first two take 1 and 2 x (r + 1) ms, its third 3 - r ms (the slowest rank is
    rank 2 at the first two calls and rank 0 at the third)."""
    own = [1e-3 * (rank + 1), 2e-3 * (rank + 1), 1e-3 * (3 - rank)]
    real = call_times.times
    call_times.times = lambda fn, reps, warm_up=True: own[:reps]
    try:
        return cal._collective_times("all_reduce", cal.CURVE_BLOCK_BYTES[0], n, dist.group.WORLD, 3)
    finally:
        call_times.times = real


def test_a_small_call_beside_the_step_site_is_timed_at_its_slowest_rank(ranks):
    """Not only the curves' points: every call ``_collective_times`` times (the small
    calls ``with_small_calls`` puts on the curves too) is its slowest rank's, the same
    on every rank."""
    for seconds in ranks(3).run(_collective_times_of):
        assert seconds == pytest.approx([3e-3, 6e-3, 3e-3])


def _one_way_of(rank: int, n: int) -> float:
    """Job: ``calibrate._one_way`` with rank-dependent exchange times: rank r's three
    take r + 1, 3 - r and 1 ms (its own median: 1, 2 and 1 ms on ranks 0, 1, 2)."""
    own = [1e-3 * (rank + 1), 1e-3 * (3 - rank), 1e-3]
    real = call_times.times
    call_times.times = lambda fn, reps, warm_up=True: own[:reps]
    try:
        return cal._one_way(cal._peers(rank, cal.one_ring(n)), 4096, 3)
    finally:
        call_times.times = real


def test_a_ring_exchange_is_timed_at_its_slowest_rank(ranks):
    """The link's points (the NIC's, across nodes) and the overlap probe's exchange are
    each exchange at its slowest rank, the same on every rank: ranks sharing a NIC do not
    finish together, and one rank's own times read the NIC faster than its wire."""
    assert ranks(3).run(_one_way_of) == [pytest.approx(3e-3)] * 3


def _overlap_slowdown_of(rank: int, n: int, alone_s: float, burst: bool) -> float:
    """Job: ``calibrate._overlap_slowdown`` on a clock that only matmuls advance: a
    matmul takes ``alone_s`` before the probe's first barrier (a rank alone, its peers
    idle) and 1 ms after (every rank at once), plus the core time the exchange takes
    while it is in flight: 1 ms of each matmul it overlaps, or (``burst``) 2 ms of the
    first alone. The exchange is in flight for 16 ms per ``OVERLAP_MESSAGE_BYTES``."""
    import time

    clock = [0.0]
    state = {"barriers": 0, "lands_at": -1.0, "under": 0}
    real = (time.perf_counter, torch.mm, dist.barrier, dist.batch_isend_irecv, cal._one_way)

    def exchange_s(nbytes: int) -> float:
        return 16e-3 * nbytes / cal.OVERLAP_MESSAGE_BYTES

    def mm(a, b):
        took = 1e-3 if state["barriers"] else alone_s
        if clock[0] < state["lands_at"]:
            took += (2e-3 if state["under"] == 0 else 0.0) if burst else 1e-3
            state["under"] += 1
        clock[0] += took
        return a

    def barrier(*args, **kwargs):
        state["barriers"] += 1
        return real[2](*args, **kwargs)

    def batch(ops):
        state["lands_at"], state["under"] = clock[0] + exchange_s(ops[0].tensor.numel() * 4), 0
        return real[3](ops)

    time.perf_counter = lambda: clock[0]
    torch.mm, dist.barrier, dist.batch_isend_irecv = mm, barrier, batch
    cal._one_way = lambda peers, nbytes, reps: exchange_s(nbytes)
    try:
        return cal._overlap_slowdown(rank, cal.one_ring(n), 3)
    finally:
        time.perf_counter, torch.mm, dist.barrier, dist.batch_isend_irecv, cal._one_way = real


def test_the_overlap_slowdown_compares_matmuls_of_every_rank_at_once(ranks):
    """The matmuls under the exchange against matmuls timed the same way with nothing in
    flight (every rank at once, after a barrier), not against one timed before: on 2
    nodes x 2 ranks sharing 2 cores, a matmul a rank timed while its peers waited took
    half what every rank at once took, and the probe read their compute as the
    exchange's (a slowdown of 1.28 where the exchange cost 0.04-0.10). Here: each
    matmul under the exchange 2 ms, 1 ms without, 0.5 ms alone: 1.0, not 3.0."""
    for slowdown in ranks(3).run(_overlap_slowdown_of, 0.5e-3, False):
        assert slowdown == pytest.approx(1.0)


def test_the_overlap_slowdown_counts_the_core_time_an_exchange_takes_in_bursts(ranks):
    """The exchange's cost is the span of matmuls it runs under, not the median matmul:
    a transfer takes its core time in bursts (the bench's 1 Gbit/s link: the median
    matmul under it read 0.10 where its cells lost 0.38 of the transfer's time). Here
    the exchange is in flight for 4 ms and takes 2 ms of one matmul of the span: half
    the core while in flight, a slowdown of 1.0, where the median matmul says 0."""
    for slowdown in ranks(3).run(_overlap_slowdown_of, 1e-3, True):
        assert slowdown == pytest.approx(1.0)


def test_the_matmuls_the_add_and_the_op_graph_are_timed_in_rounds_too(monkeypatch):
    """``call_times.in_rounds``, which times the matmul shapes, the add and the op graph:
    every call in each of ``CURVE_ROUNDS`` rounds, its calls split among them and warmed
    up once; a slow round (every call 100x) moves no median."""
    order: list[tuple[str, int, bool]] = []

    def timed(fn, reps, warm_up=True):
        order.append((fn(), reps, warm_up))
        return [(100.0 if len(order) <= 2 else 1.0) * {"a": 1e-3, "b": 2e-3}[fn()]] * reps

    monkeypatch.setattr(call_times, "times", timed)
    times = call_times.in_rounds({"a": (lambda: "a", 9), "b": (lambda: "b", 36)})
    assert order == [("a", 3, True), ("b", 9, True)] + [("a", 3, False), ("b", 9, False)] * (
        call_times.CURVE_ROUNDS - 1
    )
    assert times == {"a": 1e-3, "b": 2e-3}


def test_the_smallest_collectives_are_taken_from_the_step_sites_rounds():
    """``calibrate.with_small_calls``: each collective's smallest block on the whole ring
    is the one timed beside the step site (``FixedCostProbe.small_calls_s``), so that a
    decode step's all-reduce and a ring's P2P steps are priced from one machine state;
    the other sizes and group sizes keep the curves' own points."""
    p, n = BUILTIN["gloo-loopback"], 3
    m = _measurements_of(p, n)
    small = tuple(0.001 * (i + 1) for i in range(len(COLLECTIVES)))
    probed = dataclasses.replace(m, fixed=dataclasses.replace(m.fixed, small_calls_s=small))
    before, after = (fit.profile_from(x, n, "p", "s") for x in (m, probed))
    for collective, seconds in zip(COLLECTIVES, small, strict=True):
        points = after.curve(collective, n).points
        assert points[0] == (float(cal.CURVE_BLOCK_BYTES[0]), seconds)
        assert points[1:] == before.curve(collective, n).points[1:]
        assert after.curve(collective, 2) == before.curve(collective, 2)
