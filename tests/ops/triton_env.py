"""The Triton modules for op tests: on a machine without a GPU they run under Triton's CPU
interpreter, which must be switched on before triton is first imported (importing this module
does it)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_module(name: str):
    """(hyla.ops.triton.<name>, the device its tests use); skips when triton cannot run here."""
    pytest.importorskip("triton")
    from hyla.ops import triton as hyla_triton

    if not torch.cuda.is_available() and not hyla_triton.interpreting():
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    return importlib.import_module(f"hyla.ops.triton.{name}"), "cuda" if torch.cuda.is_available() else "cpu"
