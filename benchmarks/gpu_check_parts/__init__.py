"""The parts of ``benchmarks/gpu_check.py``: where it runs and how big (``mode``), the
split GEMMs and the profile fitted on them (``split_gemm``), and the TP+SP block with its
programs checked and its compute side timed (``block``)."""
