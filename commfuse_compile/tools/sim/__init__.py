"""``commfuse sim``: what decomposition buys a real model's layer, without a cluster.

``layer``: a dense transformer layer under tensor + sequence parallelism, Ulysses
sequence parallelism and plain tensor parallelism; ``moe``: an MoE layer's expert
parallelism. Both simulate each site on a machine profile with ``cost.simulator``.
"""
