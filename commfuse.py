"""The ``commfuse`` name for torch's logging: ``TORCH_LOGS="+commfuse"``.

torch checks every name in TORCH_LOGS when it is imported, before any extension can
register a log of its own; a name it can find as a module is accepted and enables the
logger of that name. This module exists to be found; the pass logs to ``commfuse``.
The package itself is ``commfuse_compile``.
"""
