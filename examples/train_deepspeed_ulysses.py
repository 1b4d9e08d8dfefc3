"""Train a transformer written as DeepSpeed-Ulysses writes it, with backend="commfuse".

    torchrun --nproc-per-node 2 examples/train_deepspeed_ulysses.py --steps 3 --compare
    torchrun --nproc-per-node 4 examples/train_deepspeed_ulysses.py --steps 3 --compare \
        --gqa 4 --fused-qkv
        [--inner eager|inductor] [--schedule ring|auto|off]

Activations are sequence-first ``[s, b, h]``, sharded on the sequence; every weight is
whole on every rank. Attention is wrapped the way DeepSpeed's ``DistributedAttention``
wraps it: q, k and v ``[s/n, b, heads, d]`` go through an ``autograd.Function`` like
``_SeqAllToAll`` (the heads scattered, the sequence gathered: the blocks made contiguous,
``out = torch.empty_like(...)``, ``dist.all_to_all_single(out, ...)``), local attention
sees every token of this rank's heads, and the output goes back the other way
(``commfuse_compile/tools/training/styles.py``). The gradients of the replicated weights are summed
over the ranks after the backward (like DDP). ``--gqa N``: N k/v heads (the number of
ranks must divide N); ``--fused-qkv``: q, k and v as one linear. ``--compare`` also
trains without the pass and prints the largest relative loss difference.
"""

from __future__ import annotations

from commfuse_compile.tools.training import examples as training_examples

if __name__ == "__main__":
    training_examples.ulysses_example("deepspeed", __doc__.splitlines()[0])
