"""MXFP4 weights in the compressed-tensors layout (Kimi K3's released experts), dequantised on load.

A linear weight W [N, K] is stored as two uint8 tensors beside each other:

    <name>.weight_packed  [N, K/2]   two FP4 (E2M1) codes per byte: column 2i in the low nibble,
                                     column 2i+1 in the high nibble
    <name>.weight_scale   [N, K/32]  one E8M0 exponent per group of 32 columns: 2^(s - 127)
                                     (s = 255 is E8M0's NaN)

    W[n, c] = E2M1(code[n, c]) * 2^(scale[n, c // 32] - 127),
    E2M1 codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign.

`safe_open` is a drop-in for safetensors' `safe_open` used by hyla.models.loader: it shows each
such pair as one logical tensor `<name>.weight` of shape [N, K] and dequantises it (fp32,
exact) only when it is read, so the loader copies one expert's matrix at a time into the stacked
expert tensors (hyla.layers.moe.StackedExperts) and never holds a second copy of the experts.
Any other tensor passes through unchanged; `logical_weight_map` does the same renaming for a
sharded checkpoint's index. On the GPU the weights are then bf16 (keeping them packed for the
fused-MoE kernel is not implemented).
"""

from __future__ import annotations

import torch
from safetensors import safe_open as _safe_open

GROUP = 32
PACKED, SCALE = ".weight_packed", ".weight_scale"
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed: uint8 [..., N, K/2]; scale: uint8 (E8M0) [..., N, K/32] -> W [..., N, K] in dtype."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 expects uint8 weight_packed and weight_scale, got {packed.dtype}, {scale.dtype}")
    k = 2 * packed.shape[-1]
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * GROUP != k:
        raise ValueError(f"MXFP4 scale {tuple(scale.shape)} does not hold one exponent per {GROUP} columns "
                         f"of a {tuple(packed.shape[:-1]) + (k,)} weight")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()  # [..., N, K], low nibble first
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    values = lut[codes & 0x7] * (1.0 - 2.0 * (codes >> 3).float())
    exponent = scale.float() - 127.0
    factor = torch.where(scale == 255, torch.nan, torch.exp2(exponent))  # [..., N, K/32]
    return (values.unflatten(-1, (-1, GROUP)) * factor[..., None]).flatten(-2).to(dtype)


def _logical(names) -> dict[str, tuple[str, str]]:
    """{logical `<base>.weight`: (packed name, scale name)} for every complete pair in `names`."""
    names = set(names)
    return {n[: -len(PACKED)] + ".weight": (n, n[: -len(PACKED)] + SCALE)
            for n in names if n.endswith(PACKED) and n[: -len(PACKED)] + SCALE in names}


def logical_weight_map(files: dict[str, str]) -> dict[str, str]:
    """{checkpoint tensor: file} with each MXFP4 pair replaced by its logical `.weight` name."""
    pairs = _logical(files)
    for name, (packed, scale) in pairs.items():
        if files[packed] != files[scale]:  # each shard is opened on its own: a pair must share one
            raise ValueError(f"MXFP4 tensors {packed} and {scale} are in different shards "
                             f"({files[packed]}, {files[scale]}); hyla reads a pair from one file")
    hidden = {name for pair in pairs.values() for name in pair}
    out = {name: file for name, file in files.items() if name not in hidden}
    out.update({name: files[packed] for name, (packed, _) in pairs.items()})
    return out


class _Slice:
    """What `get_slice` returns: a shape and indexing (a tensor-parallel read cuts the result)."""

    def __init__(self, f: _MxFp4File, name: str):
        self.f, self.name = f, name

    def get_shape(self) -> list[int]:
        return self.f.shape(self.name)

    def __getitem__(self, index) -> torch.Tensor:
        return self.f.get_tensor(self.name)[index]


class _MxFp4File:
    def __init__(self, f):
        self._f = f
        self._pairs = _logical(f.keys())
        self._hidden = {name for pair in self._pairs.values() for name in pair}

    def keys(self) -> list[str]:
        return [n for n in self._f.keys() if n not in self._hidden] + sorted(self._pairs)

    def shape(self, name: str) -> list[int]:
        if name not in self._pairs:
            return list(self._f.get_slice(name).get_shape())
        rows, half = self._f.get_slice(self._pairs[name][0]).get_shape()
        return [rows, 2 * half]

    def get_slice(self, name: str):
        return self._f.get_slice(name) if name not in self._pairs else _Slice(self, name)

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self._pairs:
            return self._f.get_tensor(name)
        packed, scale = self._pairs[name]
        return dequantize_mxfp4(self._f.get_tensor(packed), self._f.get_tensor(scale))

    def metadata(self):
        return self._f.metadata()


class safe_open:  # noqa: N801 (safetensors' name, so the loader swaps one import)
    """safetensors.safe_open with MXFP4 pairs shown as dequantised `.weight` tensors."""

    def __init__(self, filename, framework: str = "pt", device: str = "cpu"):
        self._cm = _safe_open(filename, framework, device=device)

    def __enter__(self) -> _MxFp4File:
        return _MxFp4File(self._cm.__enter__())

    def __exit__(self, *exc) -> None:
        self._cm.__exit__(*exc)
