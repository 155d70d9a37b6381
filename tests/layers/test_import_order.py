"""Importing the stack must not import triton: the CI's interpreter tests set TRITON_INTERPRET
after other test modules imported hyla, and triton reads it once, when it is first imported."""

from __future__ import annotations

import subprocess
import sys


def test_importing_hyla_does_not_import_triton():
    code = ("import sys, hyla.layers, hyla.models, hyla.engine, hyla.ops; "
            "bad = [m for m in ('triton', 'torch._dynamo') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
