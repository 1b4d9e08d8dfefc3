"""commfuse-compile: hide all-gather / reduce-scatter behind the matmuls next to them.

``torch.compile(model, backend="commfuse")`` (registered as an entry point) or
``commfuse_compile.apply(graph_module_or_exported_program)``.
"""

from .api import apply
from .backend import commfuse_backend
from .options import CommfuseOptionError, Options
from .report import REPORT, SiteRecord

__all__ = ["REPORT", "CommfuseOptionError", "Options", "SiteRecord", "apply", "commfuse_backend"]
__version__ = "0.1.0"
