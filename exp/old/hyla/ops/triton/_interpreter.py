"""Compatibility shim for Triton's CPU interpreter (TRITON_INTERPRET=1), used by CI.

The interpreter turns a scalar tensor into a Python int with `int(ndarray)`; its scalars are
1-element 1-D arrays, which NumPy >= 2.4 refuses to convert that way. Our kernels loop over
bounds loaded from memory (`for c in range(tl.load(lo), tl.load(hi))`), which goes through that
conversion. This re-registers the conversion with `.reshape(-1)[0]`. Applied only while
interpreting and only if the interpreter still has the hook it replaces.
"""

from __future__ import annotations

import os

_applied = False


def apply() -> None:
    global _applied
    if _applied or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    _applied = True
    try:
        import numpy as np
        import triton.runtime.interpreter as interp
    except ImportError:  # pragma: no cover
        return
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None:  # pragma: no cover - a Triton without the hook
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched
