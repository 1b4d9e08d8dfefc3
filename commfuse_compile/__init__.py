"""commfuse-compile: hide all-gather / reduce-scatter behind the matmuls next to them.

``torch.compile(model, backend="commfuse")`` (registered as an entry point),
``commfuse_compile.install_inductor_pass()`` (the pass inside ``backend="inductor"``) or
``commfuse_compile.apply(graph_module_or_exported_program)``;
``commfuse_compile.register_collective_op`` tells it what a framework's custom op
collective computes.
"""

from ._torch_support import UnsupportedTorchError, require_supported_torch

require_supported_torch()  # before anything below reaches into Inductor

from .api import apply  # noqa: E402
from .backend import commfuse_backend  # noqa: E402
from .inductor_pass import (  # noqa: E402
    install_inductor_pass,
    installed_inductor_pass,
    uninstall_inductor_pass,
)
from .options import CommfuseOptionError, Options  # noqa: E402
from .passes.fx.custom_ops import register_collective_op, unregister_collective_op  # noqa: E402
from .report import REPORT, SiteRecord  # noqa: E402

__all__ = [
    "REPORT",
    "CommfuseOptionError",
    "Options",
    "SiteRecord",
    "UnsupportedTorchError",
    "apply",
    "commfuse_backend",
    "install_inductor_pass",
    "installed_inductor_pass",
    "register_collective_op",
    "uninstall_inductor_pass",
    "unregister_collective_op",
]
__version__ = "0.1.0"
