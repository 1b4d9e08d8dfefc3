"""The FX vocabulary: sizes (``dims``), nodes and their readers (``graph``), matmuls
(``matmuls``), collectives (``collectives``, ``custom_ops``: those frameworks register
as ops of their own) and the decline codes (``declines``). Nothing here changes a
graph."""
