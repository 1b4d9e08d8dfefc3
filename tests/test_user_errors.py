"""What a user who gets something wrong sees: one message that says what is wrong and
what to do, never a traceback, from the command line, the options (given or from the
environment), profile files, ``apply`` and ``torch.compile``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from cases import AgMm, trace
from torch._dynamo.exc import BackendCompilerFailed
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse_compile
from commfuse_compile import CommfuseOptionError, Options
from commfuse_compile.cost.profiles import BUILTIN
from commfuse_compile.passes import resolve_options
from commfuse_compile.tools.cli import main

N, RANK = 2, 1
P2P = torch.ops.commfuse.p2p.default


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The working directory is ``tmp_path``, which holds a file named ``afile``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    return tmp_path


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def ag_mm() -> torch.fx.GraphModule:
    """An all-gather -> matmul graph, as rank RANK of the fake group traces it."""
    return trace(AgMm(), N, AgMm().inputs(RANK, seed=0))


def p2p_ops(gm: torch.fx.GraphModule) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=P2P))


# ----------------------------------------------------------------------------------------
# the command line


def _write_profile(name: str, fields: object) -> str:
    with open(name, "w") as file:
        json.dump(fields, file)
    return name


CLI_ERRORS = [
    (["demo", "--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["demo", "--steps", "-1"], "argument --steps: must be an integer >= 1, got '-1'"),
    (["calibrate", "--reps", "0"], "argument --reps: must be an integer >= 1, got '0'"),
    (
        ["demo", "--world-size", "1"],
        "argument --world-size: must be an integer >= 2 (one rank has no collectives to "
        "rewrite), got '1'",
    ),
    (
        ["demo", "--world-size", "3"],
        "argument --world-size: the block's 4 attention heads are split over the ranks: give "
        "a world size that divides 4",
    ),
    (["calibrate", "--world-size", "0"], "argument --world-size: must be an integer >= 2"),
    (["bench", "--world-size", "1"], "argument --world-size: must be an integer >= 2"),
    (
        ["bench", "--kinds", "ag_mm,moe"],
        "argument --kinds: unknown cell kind 'moe': one or more of ag_mm, mm_rs, mm_a2a, "
        "a2a_mm, mm_ar_mm, a2a_experts_a2a",
    ),
    (
        ["demo", "--debug-dir", "afile"],
        "argument --debug-dir: 'afile' is a file; give a directory (it is created if missing)",
    ),
    (
        ["demo", "--debug-dir", "afile/dump"],
        "argument --debug-dir: 'afile/dump' is inside the file 'afile'",
    ),
    (["calibrate", "--out", "."], "argument --out: '.' is a directory; give a file name"),
    (["sim", "--tokens", "0"], "argument --tokens: must be an integer >= 1, got '0'"),
    (["sim", "--tokens", "-5"], "argument --tokens: must be an integer >= 1, got '-5'"),
    (["sim", "--slices", "1000"], "argument --slices: must be an integer in 2..64, got '1000'"),
    (["sim", "--slices", "1"], "argument --slices: must be an integer in 2..64, got '1'"),
    (
        ["sim", "--group-size", "2,x"],
        "argument --group-size: each comma-separated size must be an integer >= 2 (a group "
        "of ranks), got 'x'",
    ),
    (["sim", "--out", "afile"], "argument --out: 'afile' is a file"),
    (["sim", "--profile", "nope"], "argument --profile: profile 'nope' is neither a built-in"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_ERRORS, ids=" ".join)
def test_the_command_refuses_a_bad_argument_naming_the_flag(argv, message, in_tmp, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"commfuse {argv[0]}: error: {message}" in capsys.readouterr().err


def test_sim_names_what_is_wrong_in_a_profile_file(in_tmp, capsys):
    listed = _write_profile("listed.json", [1, 2])
    with pytest.raises(SystemExit):
        main(["sim", "--profile", listed])
    assert "profile file listed.json must hold a JSON object, got list" in capsys.readouterr().err
    partial = _write_profile("partial.json", {"name": "x", "source": "y"})
    with pytest.raises(SystemExit):
        main(["sim", "--profile", partial])
    assert "fields missing ['matmul_flops', 'matmul_latency_s'," in capsys.readouterr().err


def test_help_says_what_the_tool_and_every_flag_are(capsys):
    def help_of(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--help"])
        assert exit_info.value.code == 0
        return " ".join(capsys.readouterr().out.split())  # unwrapped

    assert 'the torch.compile backend (backend="commfuse")' in help_of()
    demo = help_of("demo")
    assert "the block is sharded over (default: 2)" in demo
    assert "timed training steps of each variant (default: 5)" in demo
    assert "profile file to write (default: commfuse-profile.json)" in help_of("calibrate")
    bench = help_of("bench")
    assert "results directory (default: commfuse-bench)" in bench
    assert "(about 5 minutes)" in bench


def test_help_prints_nothing_else():
    """Without NumPy (a dependency now) torch warned "Failed to initialize NumPy"."""
    proc = subprocess.run(
        [sys.executable, "-m", "commfuse_compile.tools.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stderr) == (0, "")


# ----------------------------------------------------------------------------------------
# options


def test_debug_dir_must_be_able_to_become_a_directory(in_tmp):
    with pytest.raises(CommfuseOptionError, match="option 'debug_dir': 'afile' is a file"):
        Options.from_mapping({"debug_dir": "afile"})
    with pytest.raises(CommfuseOptionError, match="'afile/x' is inside the file 'afile'"):
        Options.from_mapping({"debug_dir": "afile/x"})
    assert Options.from_mapping({"debug_dir": "new/dump"}).debug_dir == "new/dump"


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        ("COMMFUSE_DISABLE", "garbage", "cannot disable ['garbage']; names are"),
        ("COMMFUSE_PROFILE", "nope", "profile 'nope' is neither a built-in profile"),
        ("COMMFUSE_DEBUG_DIR", "afile", "'afile' is a file"),
    ],
)
def test_an_error_from_the_environment_names_the_variable(env, value, message, in_tmp, monkeypatch):
    monkeypatch.setenv(env, value)
    option = env.removeprefix("COMMFUSE_").lower()
    with pytest.raises(CommfuseOptionError) as info:
        resolve_options({})
    assert str(info.value).startswith(f"commfuse: environment variable {env} (option '{option}'): ")
    assert message in str(info.value)
    with pytest.raises(CommfuseOptionError, match=f"^commfuse: option '{option}': "):
        resolve_options({option: [value] if option == "disable" else value})


@pytest.mark.parametrize(
    ("env", "value", "message"),
    [
        ("COMMFUSE_SCHEDULE", "rign", "must be one of ['auto', 'ring'"),
        ("COMMFUSE_INNER", "aot", "must be one of ['inductor', 'eager'], got 'aot'"),
        ("COMMFUSE_SLICES", "1", "must be an integer in 2..64, got 1"),
        ("COMMFUSE_SLICES", "four", "must be an integer in 2..64, got 'four'"),
        ("COMMFUSE_MEASURE", "maybe", "must be one of ['1', 'true', 'yes', 'on', '0'"),
        ("COMMFUSE_MODE", "fastest", "must be one of ['default', 'lite', 'reduce-overhead'"),
    ],
)
def test_every_option_reads_its_variable_and_a_bad_value_names_it(env, value, message, monkeypatch):
    monkeypatch.setenv(env, value)
    option = env.removeprefix("COMMFUSE_").lower()
    with pytest.raises(CommfuseOptionError) as info:
        Options.from_mapping({})
    assert str(info.value).startswith(f"commfuse: environment variable {env} (option '{option}')")
    assert message in str(info.value)


def test_options_from_the_environment_explicit_ones_win_and_each_origin_is_kept(monkeypatch):
    """What torchtitan or Hugging Face's Trainer can do: pass only the backend's name."""
    for env, value in [("SCHEDULE", "ring"), ("INNER", "eager"), ("SLICES", "4")]:
        monkeypatch.setenv(f"COMMFUSE_{env}", value)
    monkeypatch.setenv("COMMFUSE_MEASURE", "yes")
    opts = Options.from_mapping({})
    assert (opts.schedule, opts.inner, opts.slices, opts.measure) == ("ring", "eager", 4, True)
    opts = Options.from_mapping({"schedule": "bidir", "measure": False})
    assert (opts.schedule, opts.inner, opts.slices, opts.measure) == ("bidir", "eager", 4, False)
    described = opts.described()
    assert described["schedule"] == {"value": "bidir", "from": "option"}
    assert described["slices"] == {"value": 4, "from": "environment variable COMMFUSE_SLICES"}
    assert described["profile"] == {"value": None, "from": "default"}
    monkeypatch.setenv("COMMFUSE_MEASURE", "0")
    assert Options.from_mapping({}).measure is False


def test_report_json_says_where_each_option_came_from(fake_world, tmp_path, monkeypatch):
    monkeypatch.setenv("COMMFUSE_SCHEDULE", "ring")
    commfuse_compile.report.reset()
    commfuse_compile.apply(ag_mm(), debug_dir=str(tmp_path), inner="eager")
    report = json.loads((tmp_path / f"rank{RANK}" / "report.json").read_text())
    assert report["options"]["schedule"] == {
        "value": "ring",
        "from": "environment variable COMMFUSE_SCHEDULE",
    }
    assert report["options"]["inner"] == {"value": "eager", "from": "option"}
    assert report["options"]["debug_dir"]["from"] == "option"
    assert [s["schedule"] for s in report["sites"]] == ["ring"]


def test_a_profile_file_names_the_curve_points_it_cannot_use(in_tmp):
    fields = BUILTIN["gloo-loopback"].as_json()
    fields["collectives"]["all_gather"]["2"]["points"] = [[4096, "fast"]]
    path = _write_profile("points.json", fields)
    with pytest.raises(
        CommfuseOptionError,
        match=re.escape("all_gather 2: points must be [block bytes, seconds] pairs"),
    ):
        Options.from_mapping({"profile": path})


# ----------------------------------------------------------------------------------------
# apply and torch.compile


def test_apply_takes_options_as_the_backend_does_or_as_keywords(fake_world):
    assert p2p_ops(commfuse_compile.apply(ag_mm(), options={"schedule": "ring"})) == N - 1
    assert p2p_ops(commfuse_compile.apply(ag_mm(), schedule="ring")) == N - 1
    with pytest.raises(CommfuseOptionError, match="as options=.* or as keywords, not both"):
        commfuse_compile.apply(ag_mm(), options={"schedule": "ring"}, slices=4)


def test_apply_refuses_an_inner_compiler_it_would_not_run(fake_world):
    gm = ag_mm()
    before = gm.code
    with pytest.raises(CommfuseOptionError, match="'inductor': apply .* compiles nothing"):
        commfuse_compile.apply(gm, options={"schedule": "ring", "inner": "inductor"})
    assert gm.code == before
    assert p2p_ops(commfuse_compile.apply(gm, schedule="ring", inner="eager")) == N - 1


def test_a_dump_that_cannot_be_written_warns_and_the_rewrite_goes_on(fake_world, tmp_path):
    (tmp_path / f"rank{RANK}").write_text("")  # the rank's directory cannot be made
    with pytest.warns(UserWarning, match=re.escape(f"cannot write the debug dump to {tmp_path}")):
        gm = commfuse_compile.apply(ag_mm(), schedule="ring", debug_dir=str(tmp_path))
    assert p2p_ops(gm) == N - 1


def test_torch_compile_raises_a_bad_option_as_itself():
    """Dynamo gives the backend its options at the first call, and would wrap the error."""
    torch._dynamo.reset()
    model = torch.compile(torch.nn.Linear(4, 4), backend="commfuse", options={"schedule": "rnig"})
    try:
        with pytest.raises(CommfuseOptionError) as info:
            model(torch.randn(2, 4))
    finally:
        torch._dynamo.reset()
    assert not isinstance(info.value, BackendCompilerFailed)
    assert str(info.value).startswith("commfuse: option 'schedule' must be one of ['auto',")
