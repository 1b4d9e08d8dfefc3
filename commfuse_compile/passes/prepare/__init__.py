"""The rewrites before matching: each leaves a graph that computes the same numbers, in
a shape the kinds match (``canonical``: a framework's spellings of one pattern;
``unfuse``: fused ops taken apart; ``shard_tokens``: plain tensor parallelism's
all-reduces split into sequence parallelism; ``merge_reduces``: sums of reduced values
reduced once)."""
