"""What the ranks of a group must share: the decisions on every site (``agree``), the
order of their transfers (``sequence``, pinned by ``order``), and the transfers of the
program Inductor generated, read back (``program``)."""
