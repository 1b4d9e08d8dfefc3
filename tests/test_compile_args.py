"""torch.compile's own arguments with ``backend="commfuse"``: ``mode`` reaches the inner
Inductor as it would with ``backend="inductor"`` (its config while Inductor compiles),
as the ``mode`` option too (torch.compile refuses ``mode`` with ``options``); with the
eager inner compiler a warning says it does not apply; compile_fx's keyword arguments
(Dynamo's ``config_patches``) pass on, others are ignored with a warning; a graph with
P2P steps runs without CUDA graphs under a mode that has them (Inductor says why), one
the pass left whole keeps them; transformers' ``CompileConfig(backend="commfuse")``
with its default ``mode="reduce-overhead"`` compiles ``generate``'s decode steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cases import AgMm, trace
from torch._inductor import config as inductor_config
from torch._inductor.utils import get_first_incompatible_cudagraph_node
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse_compile
from commfuse_compile import CommfuseOptionError, backend
from commfuse_compile.options import MODES

P2P = torch.ops.commfuse.p2p.default
N, RANK = 2, 1
INDUCTOR_SEEN = ("max_autotune", "coordinate_descent_tuning", "triton.cudagraphs")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def inductor_config_seen(monkeypatch) -> list[dict[str, object]]:
    """Inductor's config at each graph compile (``compile_fx_inner``'s calls)."""
    import torch._inductor.compile_fx as compile_fx

    seen: list[dict[str, object]] = []
    real = compile_fx.compile_fx_inner

    def recording(*args, **kwargs):
        seen.append({name: inductor_config.get_config_copy()[name] for name in INDUCTOR_SEEN})
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", recording)
    return seen


def pointwise(x: torch.Tensor) -> torch.Tensor:
    """No matmul: nothing for max-autotune to tune on the CPU."""
    return torch.sin(x) * 2 + 1


def traced() -> torch.fx.GraphModule:
    """``pointwise`` as Dynamo hands a backend its graph (outputs in a tuple)."""
    return torch.fx.symbolic_trace(lambda x: (pointwise(x),))


def compiled_with(**kwargs):
    x = torch.randn(4, 8)
    out = torch.compile(pointwise, backend="commfuse", **kwargs)(x)
    torch.testing.assert_close(out, pointwise(x))


@pytest.mark.parametrize("mode", ["max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead"])
def test_mode_reaches_the_inner_inductor_as_with_backend_inductor(
    mode, fresh_dynamo, inductor_config_seen
):
    compiled_with(mode=mode)
    expected = {name: inductor_config.get_config_copy()[name] for name in INDUCTOR_SEEN}
    expected.update(torch._inductor.list_mode_options(mode))
    assert inductor_config_seen == [expected]
    assert inductor_config.max_autotune is False  # patched for the compile only


def test_mode_as_an_option_beside_the_others(fresh_dynamo, inductor_config_seen):
    compiled_with(options={"schedule": "ring", "mode": "max-autotune-no-cudagraphs"})
    assert [seen["max_autotune"] for seen in inductor_config_seen] == [True]


def test_config_patches_as_dynamo_gives_them_win_over_the_mode(inductor_config_seen):
    gm = traced()
    compiled = backend.commfuse_backend(
        gm,
        [torch.randn(4, 8)],
        mode="max-autotune-no-cudagraphs",
        config_patches={"coordinate_descent_tuning": False},
    )
    assert compiled is not None
    assert [(s["max_autotune"], s["coordinate_descent_tuning"]) for s in inductor_config_seen] == [
        (True, False)
    ]


def test_an_unknown_keyword_is_ignored_with_a_warning():
    gm = traced()
    with pytest.warns(UserWarning, match=r"commfuse: backend ignoring keyword arguments \['x'\]"):
        backend.commfuse_backend(gm, [torch.randn(4, 8)], options={"inner": "eager"}, x=1)


def test_with_the_eager_inner_compiler_the_mode_is_noted_as_not_applying(fresh_dynamo):
    with pytest.warns(UserWarning, match="mode='max-autotune' configure Inductor; they do not"):
        compiled_with(options={"inner": "eager", "mode": "max-autotune"})


def test_a_mode_torch_does_not_know_is_refused_naming_the_modes(fresh_dynamo):
    with pytest.raises(CommfuseOptionError, match=r"option 'mode' must be one of \['default',"):
        compiled_with(mode="fastest")
    with pytest.raises(CommfuseOptionError, match="mode='max-autotune' and option 'mode'"):
        backend.commfuse_backend(
            traced(),
            [torch.randn(4, 8)],
            options={"mode": "reduce-overhead"},
            mode="max-autotune",
        )
    assert set(MODES) >= {"default", "reduce-overhead", "max-autotune"}


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=N, store=FakeStore())
    yield
    dist.destroy_process_group()


def test_a_graph_with_p2p_steps_is_kept_out_of_cuda_graphs(fake_world):
    """Its P2P op is ``cudagraph_unsafe``; under a mode with CUDA graphs, Inductor's
    partitions around it are off for such a graph, so Inductor runs it without CUDA
    graphs (``get_first_incompatible_cudagraph_node``: the reason it logs); a graph
    without one is left to Inductor."""
    gm = trace(AgMm(), N, AgMm().inputs(RANK, seed=0))
    untouched = inductor_config.graph_partition
    with inductor_config.patch({"triton.cudagraphs": True}):
        with backend._no_cudagraph_partitions(gm):
            assert inductor_config.graph_partition == untouched
        commfuse_compile.apply(gm, schedule="ring")
        assert get_first_incompatible_cudagraph_node(gm).target is P2P
        with backend._no_cudagraph_partitions(gm):
            assert inductor_config.graph_partition is False
    assert untouched == inductor_config.graph_partition
    with backend._no_cudagraph_partitions(gm):  # no CUDA graphs: nothing to keep out
        assert inductor_config.graph_partition == untouched


def test_apply_and_the_inductor_pass_refuse_a_mode(fake_world):
    """Neither runs Inductor with a mode of its own: apply compiles nothing, the installed
    pass runs in the Inductor torch.compile gave its mode to."""
    with pytest.raises(CommfuseOptionError, match="option 'mode' cannot be 'max-autotune'"):
        commfuse_compile.apply(trace(AgMm(), N, AgMm().inputs(RANK, seed=0)), mode="max-autotune")
    with pytest.raises(CommfuseOptionError, match="takes its mode from torch.compile"):
        commfuse_compile.install_inductor_pass(mode="reduce-overhead")
    assert commfuse_compile.installed_inductor_pass() is None
