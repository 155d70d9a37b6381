"""Compatibility and speed shim for Triton's CPU interpreter (TRITON_INTERPRET=1), used by CI.

The changes below apply only while interpreting, each only if the interpreter still has the hook it
replaces; none changes what a kernel computes (the scan's floating-point order aside, see there):

- The interpreter turns a scalar tensor into a Python int with `int(ndarray)`; its scalars are
  1-element 1-D arrays, which NumPy >= 2.4 refuses to convert that way. Our kernels loop over
  bounds loaded from memory (`for c in range(tl.load(lo), tl.load(hi))`), which goes through that
  conversion. This re-registers the conversion with `.reshape(-1)[0]`.
- Every call of a @triton.jit helper inside an interpreted kernel re-patches `triton.language`
  (`_patch_lang`: a walk over every member of the language modules its function's globals name),
  once per helper call and program (about a tenth of the KDA chunk tests' time). The patch a
  launch applies stays in place until the launch ends, so a helper whose language modules the
  launch has already patched needs nothing; a helper naming a module not yet patched in this
  launch (the standard library's functions name `triton.language.core`) patches it as before.
  The launch's own patch and its restore are unchanged.
- `tl.associative_scan` with a combine function other than a sum or product runs element by
  element in the interpreter (one Python call of the combine function per element: half of the
  KDA chunk tests' time, for the sub-block segmented cumsum). It runs here as a Hillis-Steele scan
  instead: log2(n) calls of the combine function on whole shifted blocks, which a combine function
  (elementwise, associative, as Triton requires) computes the same way; floating-point sums come
  out in a tree order, as on the GPU, instead of the interpreter's left-to-right one.
- The interpreter maps a Triton dtype to its NumPy storage dtype by building a 19-entry dict at
  every call (hundreds of thousands of calls a test file); the map is built once here.
- Every interpreted operation builds `tl.tuple` values whose `tuple_type` formats its display name
  at construction (millions of strings a test file, almost never read); the name is formatted when
  first read instead, the same string.
"""

from __future__ import annotations

import inspect
import os

_applied = False


def apply() -> None:
    global _applied
    if _applied or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    _applied = True
    try:
        import numpy as np
        import triton.language as tl
        import triton.runtime.interpreter as interp
    except ImportError:  # pragma: no cover
        return
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is not None:

        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

        interp._patch_lang_tensor = patched

    np_dtype = getattr(interp, "_get_np_dtype", None)
    if np_dtype is not None:
        interp._get_np_dtype = _cached_np_dtype(np_dtype, tl)

    _lazy_tuple_type_names(tl.core)

    scan_ops = getattr(interp, "ScanOps", None)
    if scan_ops is not None and hasattr(scan_ops, "generic_scan"):
        scan_ops.generic_scan = _doubling_scan

    patch_lang = getattr(interp, "_patch_lang", None)
    executor = getattr(interp, "GridExecutor", None)
    scope_type = getattr(interp, "_LangPatchScope", None)
    if patch_lang is None or executor is None or scope_type is None:  # pragma: no cover - another Triton
        return
    launch = executor.__call__
    patched_in_launch: set[int] = set()  # ids of the language modules the running launch has patched
    langs_of: dict[object, frozenset[int]] = {}

    def languages(fn) -> frozenset[int]:
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and (v is tl or v is tl.core))
        return langs_of[fn]

    def patch_lang_once(fn):
        langs = languages(fn)
        if langs and langs <= patched_in_launch:
            return scope_type()  # nothing changed, nothing to restore
        scope = patch_lang(fn)
        patched_in_launch.update(langs)
        return scope

    def run_launch(self, *args, **kwargs):
        patched_in_launch.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched_in_launch.clear()

    interp._patch_lang = patch_lang_once
    executor.__call__ = run_launch


def _doubling_scan(self, inputs):
    """ScanOps.generic_scan's contract (`inputs`: a tuple of block tensors of one shape; returns a
    list of tensors, the inclusive scan of each along self.axis under self.combine_fn) computed in
    ceil(log2(n)) steps: at step d every position i >= d combines position i - d's running value
    with its own."""
    import numpy as np

    axis = self.axis
    values = [np.array(t.handle.data) for t in inputs]
    dtypes = [t.dtype for t in inputs]
    n = values[0].shape[axis]
    d = 1
    while d < n:
        # position i's partner i - d; the first d positions (no partner) combine with themselves
        # (Triton blocks keep power-of-two shapes) and keep their values
        partner = np.concatenate([np.arange(d), np.arange(n - d)])
        earlier = [self.to_tensor(np.take(v, partner, axis=axis), dt) for v, dt in zip(values, dtypes)]
        later = [self.to_tensor(v, dt) for v, dt in zip(values, dtypes)]
        out = self.combine_fn.fn(*earlier, *later)
        out = out if isinstance(out, tuple) else (out,)
        tail = [slice(None)] * values[0].ndim
        tail[axis] = slice(d, n)
        tail = tuple(tail)
        for v, o in zip(values, out):  # earlier / later are copies (take, astype): safe to write in place
            v[tail] = np.broadcast_to(o.handle.data if hasattr(o, "handle") else o, v.shape)[tail]
        d *= 2
    return [self.to_tensor(v, dt) for v, dt in zip(values, dtypes)]


def _cached_np_dtype(np_dtype, tl):
    """The interpreter's `_get_np_dtype(tt_dtype)` with its answers kept per element type (a block
    type answers as its element type does; pointers are the interpreter's uint64)."""
    import numpy as np

    known: dict = {}
    pointer = np.dtype(np.uint64)

    def get(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if tt_dtype not in known:
            known[tt_dtype] = np_dtype(tt_dtype)
        return known[tt_dtype]

    return get


def _lazy_tuple_type_names(core) -> None:
    """tuple_type(types, fields) without formatting `name` until it is read (then kept)."""
    cls = getattr(core, "tuple_type", None)
    if cls is None or "name" in cls.__dict__:  # pragma: no cover - another Triton, or done
        return
    code = cls.__init__.__code__
    if code.co_varnames[:code.co_argcount] != ("self", "types", "fields") or "name" not in code.co_names:
        return  # pragma: no cover - a constructor other than the one replaced here

    def __init__(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    def name(self):
        if "_name" not in self.__dict__:
            self._name = "[" + ",".join(f"{k}:{v}" for k, v in zip(self.fields, self.types)) + "]"
        return self._name

    def set_name(self, value):
        self._name = value

    cls.__init__ = __init__
    cls.name = property(name, set_name)
