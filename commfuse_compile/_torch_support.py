"""The torch line this package supports, checked when the package is imported.

The pass relies on the aten-level graphs, functional collectives and Inductor internals
of one torch line; on another, the first compile would fail deep inside Inductor. So the
import (``torch.compile(..., backend="commfuse")`` loads it through the entry point, the
command line and ``commfuse_compile.apply`` import it too) says which torch it needs.
"""

from __future__ import annotations

import re

import torch

SUPPORTED_LINE = (2, 13)
# pyproject.toml's torch requirement, the same range (a test holds the two together): the
# whole 2.13 line, with its nightlies (2.13.0.dev...) and source builds (2.13.0a0+git...),
# which a plain ">=2.13" would make pip replace.
SUPPORTED_RANGE = ">=2.13.0.dev0,<2.14"


class UnsupportedTorchError(ImportError):
    """The installed torch is not of the supported line."""


def torch_line(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``"2.13.1+cu128"`` -> ``(2, 13)``)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def require_supported_torch() -> None:
    """Raise :class:`UnsupportedTorchError`, naming the supported range, on another torch."""
    version = str(torch.__version__)
    if torch_line(version) != SUPPORTED_LINE:
        raise UnsupportedTorchError(
            f"commfuse-compile supports torch{SUPPORTED_RANGE} (the 2.13 line); this is "
            f"torch {version}. Install a supported torch, e.g. pip install 'torch==2.13.0', "
            "or leave backend='commfuse' out of torch.compile."
        )
