"""Real Megatron-Core (megatron-core 0.16.1, the ``megatron`` test extra) under
``backend="commfuse"``, with no workaround of the compiler's.

Its ``ColumnParallelLinear`` / ``RowParallelLinear`` with sequence parallelism, and its
``TransformerLayer`` from ``get_gpt_layer_local_spec``, on gloo ranks: 2 training steps
compiled and uncompiled, equal losses and gradients, and every sequence-parallel
all-gather -> matmul and matmul -> reduce-scatter rewritten, forward and backward. Its
``RowParallelLinear`` warns on rank 0 only (``get_tensor_model_parallel_group_if_none``:
a ``DeprecationWarning``, ``stacklevel=2``): one graph on every rank all the same
(``deferred_logging.py``), the warning as often as uncompiled, on rank 0. Its attention
hands ``baddbmm(..., beta=0.0)`` a region of the global memory buffer the column-parallel
linear gathered into: not a read of the buffer (``canonical.py``), so the qkv gather is
rewritten too.

Megatron-Core is a CUDA library; on CPU it runs with what these ranks set up, none of
it about the compiler: ``torch.cuda.current_device`` gives ``"cpu"`` (its buffers and
gradients are made on ``torch.cuda.current_device()``), ``CUDA_DEVICE_MAX_CONNECTIONS=1``
(which Megatron asks for with sequence parallelism; unset, its first call warns and
stores ``warned`` on a function, a graph break on every rank alike), a LayerNorm that
takes sequence parallelism in the local spec (its torch fallback for apex refuses it),
and a causal mask on CPU (its default mask is made on ``"cuda"``). The uncompiled steps
come first: they make the global memory buffer. Made inside the first compiled step
instead, the buffer leaves the column-parallel linear's ``autograd.Function`` with that
function's ``grad_fn``, and the next step's attention backpropagates into the previous
step's graph: "Trying to backward through the graph a second time", under any AOT
backend (``aot_eager`` included), a torch 2.13 fault.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
import warnings

import pytest
import torch

from commfuse_compile import report

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install '.[megatron]')",
)

# TOKENS per rank: the attention's scores [b * heads/n, s, s] outgrow the gathered input
# [s, b, h] in the global memory buffer (heads/n * s > h), as at any real sequence length,
# so every gather writes a part of the buffer
HIDDEN, TOKENS, STEPS = 48, 16, 2
WARNING = "tp_group is None, using default tp group"

# (model, inner) -> {(graph, kind): sites per rank}: every collective of the graphs
SITES = {
    ("linears", "eager"): {
        ("forward", "ag_mm"): 1,
        ("forward", "mm_rs"): 1,
        ("backward", "ag_mm"): 2,
        ("backward", "mm_rs"): 1,
    },
    ("linears", "inductor"): {
        ("forward", "ag_mm"): 1,
        ("forward", "mm_rs"): 1,
        ("backward", "ag_mm"): 1,
        ("backward", "mm_rs"): 1,
    },
    ("layer", "eager"): {
        ("forward", "ag_mm"): 2,
        ("forward", "mm_rs"): 2,
        ("backward", "ag_mm"): 4,
        ("backward", "mm_rs"): 2,
    },
    ("layer", "inductor"): {
        ("forward", "ag_mm"): 2,
        ("forward", "mm_rs"): 2,
        ("backward", "ag_mm"): 2,
        ("backward", "mm_rs"): 2,
    },
}


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """A LayerNorm with the signature of Megatron-Core's norms, its parameters marked
    ``sequence_parallel`` as its ``FusedLayerNorm`` marks them (for the gradients'
    all-reduce its trainer runs after the backward, outside the layer)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def megatron_on_cpu(n: int):
    """Megatron-Core on this rank's CPU, tensor- and sequence-parallel over the world:
    the set-up the module's docstring lists, undone after."""
    import torch._dynamo.trace_rules
    from megatron.core import parallel_state

    torch._dynamo.trace_rules.get_torch_obj_rule_map()  # torch's own current_device in it
    current_device, connections = (
        torch.cuda.current_device,
        os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    )
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=n, distributed_timeout_minutes=2
    )
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.cuda.current_device = current_device  # type: ignore[assignment]
        if connections is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS")
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = connections


def build(model: str, n: int):
    """The model and its step's input: ``[s/n, b, h]``, this rank's share of the tokens."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=2 * HIDDEN,
        num_attention_heads=2 * n,
        tensor_model_parallel_size=n,
        sequence_parallel=True,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
    )
    torch.manual_seed(0)
    if model == "linears":
        init = torch.nn.init.xavier_normal_
        column = tensor_parallel.ColumnParallelLinear(
            HIDDEN, 2 * HIDDEN, config=config, init_method=init, bias=True, gather_output=False
        )
        row = tensor_parallel.RowParallelLinear(
            2 * HIDDEN, HIDDEN, config=config, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False,
        )  # fmt: skip
        module = torch.nn.ModuleList([column, row])

        def forward(x):
            hidden, _ = column(x)
            out, _ = row(torch.nn.functional.gelu(hidden))
            return out

    else:
        submodules = get_gpt_layer_local_spec().submodules
        submodules.input_layernorm = SequenceParallelLayerNorm
        submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
        module = TransformerLayer(config, submodules, layer_number=1)
        tokens = TOKENS * n
        mask = torch.triu(torch.ones(1, 1, tokens, tokens, dtype=torch.bool), diagonal=1)

        def forward(x):
            out, _ = module(x, attention_mask=mask)
            return out

    return module, forward


def train(module, step, x) -> dict:
    """``STEPS`` SGD steps: the losses, the last gradients, the rank-0 warnings."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    losses, started = [], time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            optimizer.zero_grad()
            x.grad = None
            loss = step(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {
        "losses": losses,
        "grads": [x.grad.clone()] + [p.grad.clone() for p in module.parameters()],
        "warned": [(str(w.message), w.category) for w in caught if WARNING in str(w.message)],
        "seconds": time.monotonic() - started,
    }


def megatron_job(rank: int, n: int, model: str, inner: str) -> dict:
    torch.set_num_threads(1)
    with megatron_on_cpu(n):
        module, forward = build(model, n)
        start = [p.detach().clone() for p in module.parameters()]
        torch.manual_seed(rank)
        x = torch.randn(TOKENS, 2, HIDDEN, requires_grad=True)
        uncompiled = train(module, forward, x)
        with torch.no_grad():
            for p, value in zip(module.parameters(), start, strict=True):
                p.copy_(value)
        torch._dynamo.reset()
        report.reset()
        step = torch.compile(
            forward, backend="commfuse", options={"schedule": "ring", "inner": inner}
        )
        compiled = train(module, step, x)
        compiled["sites"] = [
            (r.graph, r.kind, r.decision, r.decline_code) for r in report.REPORT.sites
        ]
    return {"uncompiled": uncompiled, "compiled": compiled}


@pytest.mark.parametrize(
    ("model", "n", "inner"),
    [
        ("layer", 3, "inductor"),
        *[
            pytest.param(model, n, inner, marks=pytest.mark.matrix)
            for model in ("linears", "layer")
            for n in (2, 3, 4)
            for inner in ("eager", "inductor")
            if (model, n, inner) != ("layer", 3, "inductor")
        ],
    ],
)
def test_real_megatron_core_is_rewritten_and_trains_alike(ranks, model, n, inner):
    """Every all-gather -> matmul and matmul -> reduce-scatter of its sequence
    parallelism rewritten, forward and backward, on every rank (one compile per step's
    graphs: no divergence, no fallback); the losses and gradients of the uncompiled
    model; its rank-0 warning as uncompiled."""
    expected = SITES[(model, inner)]
    for rank, runs in enumerate(ranks(n).run(megatron_job, model, inner)):
        want, got = runs["uncompiled"], runs["compiled"]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), rank
        for g, w in zip(got["grads"], want["grads"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        counted: dict[tuple[str, str], int] = {}
        for graph, kind, decision, code in got["sites"]:
            assert (decision, code) == ("rewritten", ""), (rank, graph, kind, code)
            counted[(graph, kind)] = counted.get((graph, kind), 0) + 1
        assert counted == expected, rank
        assert got["warned"] == want["warned"]
        assert len(got["warned"]) == (STEPS * (1 if model == "linears" else 2) if rank == 0 else 0)
        assert all(category is DeprecationWarning for _, category in got["warned"])
