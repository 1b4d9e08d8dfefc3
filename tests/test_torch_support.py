"""The torch line: on another torch, importing the package (which torch.compile does for
``backend="commfuse"``) names the supported range instead of failing inside Inductor;
pyproject.toml's requirement admits the same versions as that check."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

from commfuse_compile._torch_support import (
    SUPPORTED_LINE,
    SUPPORTED_RANGE,
    UnsupportedTorchError,
    require_supported_torch,
    torch_line,
)

SUPPORTED = ["2.13.0", "2.13.0+cpu", "2.13.1+cu128", "2.13.0a0+git1234abc", "2.13.0.dev20260301"]
UNSUPPORTED = ["2.12.1", "2.14.0", "2.14.0.dev20260501+cpu", "3.13.0", "1.13.1"]


@pytest.mark.parametrize("version", UNSUPPORTED)
def test_another_torch_is_refused_naming_the_supported_range(version, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(UnsupportedTorchError) as raised:
        require_supported_torch()
    message = str(raised.value)
    assert "torch>=2.13.0.dev0,<2.14 (the 2.13 line)" in message
    assert f"this is torch {version}." in message
    assert "pip install 'torch==2.13.0'" in message


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_2_13_line_is_accepted(version, monkeypatch):
    monkeypatch.setattr(torch, "__version__", version)
    require_supported_torch()


def test_pyproject_requires_the_range_the_check_accepts():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    (required,) = re.findall(r'^dependencies = \["torch([^"]*)"', pyproject, re.MULTILINE)
    assert SpecifierSet(required) == SpecifierSet(SUPPORTED_RANGE)
    for version in SUPPORTED + UNSUPPORTED:
        admitted = SpecifierSet(required).contains(version, prereleases=True)
        assert admitted == (torch_line(version) == SUPPORTED_LINE), version


def test_torch_compile_with_the_backend_on_another_torch_says_so():
    """The entry point imports the package: the error reaches ``torch.compile``'s caller."""
    code = (
        "import torch\n"
        "torch.__version__ = '2.14.0'\n"
        "torch.compile(lambda x: x + 1, backend='commfuse')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last_line = run.stderr.strip().splitlines()[-1]
    assert last_line.startswith("commfuse_compile._torch_support.UnsupportedTorchError: ")
    assert "supports torch>=2.13.0.dev0,<2.14 (the 2.13 line); this is torch 2.14.0." in last_line
