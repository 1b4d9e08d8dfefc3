"""Train with Ulysses sequence parallelism (DeepSpeed-Ulysses) and backend="commfuse".

    torchrun --nproc-per-node 2 examples/train_ulysses.py --steps 3 --compare
    torchrun --nproc-per-node 4 examples/train_ulysses.py --steps 3 --compare --gqa 4 --fused-qkv
        [--inner eager|inductor] [--schedule ring|auto|off] [--activation-checkpointing]

Every rank holds the whole model (a small Llama-style transformer) and its block of the
sequence. In each block q, k and v are projected locally, then an all-to-all
(``all_to_all_single_autograd``) trades sequence shards for head shards, so attention
sees every token of this rank's heads; a second all-to-all trades them back before the
output projection. The SwiGLU MLP and the norms are local. After the backward the
gradients of the replicated weights are summed over the ranks (outside the compiled
region, like DDP). ``--gqa N``: N k/v heads (grouped-query attention; the number of
ranks must divide N); ``--fused-qkv``: q, k and v as one linear. Rank 0 prints the loss
and time of each step and what the pass did with every site; ``--compare`` also trains
the same model without the pass (plain eager, same initialization and data) and prints
the largest relative loss difference.
"""

from __future__ import annotations

from commfuse_compile.tools.training import examples as training_examples

if __name__ == "__main__":
    training_examples.ulysses_example("ulysses", __doc__.splitlines()[0])
