"""MXFP4 weights in the compressed-tensors layout (Kimi K3's released experts): dequantised on load,
or, for routed experts on the GPU, kept packed (Mxfp4Experts).

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
sharded checkpoint's index.

Packed experts (the GPU path). While `pack_at_load()`, each routed expert's pair is shown instead
as one uint8 tensor `<name>.weight` [N, K/2 + K/32]: its K/2 code bytes, then its K/32 scale
bytes, per row. The loader copies those rows, expert by expert, into the holder's stacked
`gate_up_proj` [E, 2I, H/2 + H/32] / `down_proj` [E, H, I/2 + I/32] buffers (the official stacked
names), whose two column ranges are the fused-MoE kernel's packed and scale views
(hyla.ops.triton.fused_moe_mxfp4): 17/64 of bf16's bytes, never a dequantised copy. A family
whose checkpoints have MXFP4 experts therefore builds Mxfp4Experts for them while
`pack_at_load()` (Kimi K3, the only such family, does: hyla.models.kimi_k3).
`mxfp4_experts` (an argument of hyla.models.loader.load_model and a field of EngineConfig, which
the loader also leaves on the family config for the family to read) chooses: `auto` (default)
packs at load when CUDA is available and keeps the experts packed on CUDA only (a CPU-loaded
model gets dequantised experts in prepare_for_inference); `packed` packs and keeps them packed on
any device (CPU tests: the kernel under TRITON_INTERPRET=1, else dequantised per call);
`dequantized` never packs; `fp8` packs at load, then converts the experts to block FP8 with
power-of-two block scales (Mxfp4Experts.to_fp8: exact wherever a 128 x 128 block's group
exponents span <= 13 binades, hyla.ops.fp8.block_quantize) run by the block-FP8 fused MoE: one
byte a weight instead of 17/32. Packed experts are a single-device format for now: the tensor /
expert-parallel plans (hyla.parallel) cut and rebuild the logical [N, K] expert weights, so `auto`
does not pack inside a process group of several ranks (where those loads run), and EngineConfig
refuses `packed` and `fp8` with tensor_parallel_size > 1.
"""

from __future__ import annotations

import math
import re

import torch
from safetensors import safe_open as _safe_open
from torch import nn

from hyla.ops.gated_act import GatedActivation

GROUP = 32
PACKED, SCALE = ".weight_packed", ".weight_scale"
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MODES = ("auto", "packed", "dequantized", "fp8")
# a routed expert's weight (per-expert checkpoint names: Kimi w1 / w3 / w2, Qwen-style names)
_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def check_experts_mode(mode: str) -> str:
    """`mode` if it is one of MODES (module docstring), else ValueError naming mxfp4_experts."""
    if mode not in MODES:
        raise ValueError(f"mxfp4_experts must be one of {MODES}, got {mode!r}")
    return mode


def _sharded() -> bool:
    """Inside a process group of several ranks: where hyla's tensor / expert-parallel loads run."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def pack_at_load(mode: str = "auto") -> bool:
    """Whether MXFP4 experts are loaded packed (Mxfp4Experts) rather than dequantised, for the
    mxfp4_experts mode: `packed`, or `auto` with CUDA available outside a multi-rank process group
    (see the module docstring)."""
    mode = check_experts_mode(mode)
    return mode in ("packed", "fp8") or (mode == "auto" and torch.cuda.is_available() and not _sharded())


def keep_packed(device: torch.device, mode: str = "auto") -> bool:
    """Whether experts loaded packed stay packed on `device` (else they are dequantised once)."""
    mode = check_experts_mode(mode)
    return mode == "packed" or (mode == "auto" and device.type == "cuda")


def is_mxfp4(quantization_config: dict | None) -> bool:
    """True for a compressed-tensors MXFP4 `quantization_config` (Kimi K3's released experts)."""
    q = quantization_config or {}
    return q.get("quant_method") == "compressed-tensors" and "mxfp4" in str(q.get("format", "")).lower()


def row_bytes(k: int) -> int:
    """Bytes of one packed row of K weights: K/2 code bytes then K/32 scale bytes."""
    if k % GROUP:
        raise ValueError(f"an MXFP4 row needs a multiple of {GROUP} columns, got {k}")
    return k // 2 + k // GROUP


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed: uint8 [..., N, K/2]; scale: uint8 (E8M0) [..., N, K/32] -> W [..., N, K] in dtype."""
    check_pair(packed, scale)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()  # [..., N, K], low nibble first
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
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
    """One open safetensors file with its MXFP4 pairs shown as logical `.weight` tensors:
    dequantised [N, K] fp32, or, for routed experts when `packed_experts`, packed rows [N, K/2 +
    K/32] uint8 (codes then scales)."""

    def __init__(self, f, packed_experts: bool):
        self._f = f
        self._pairs = _logical(f.keys())
        self._hidden = {name for pair in self._pairs.values() for name in pair}
        self._packed = {n for n in self._pairs if packed_experts and _EXPERT_WEIGHT.search(n)}

    def keys(self) -> list[str]:
        return [n for n in self._f.keys() if n not in self._hidden] + sorted(self._pairs)

    def shape(self, name: str) -> list[int]:
        if name not in self._pairs:
            return list(self._f.get_slice(name).get_shape())
        rows, half = self._f.get_slice(self._pairs[name][0]).get_shape()
        return [rows, half + half // (GROUP // 2)] if name in self._packed else [rows, 2 * half]

    def get_slice(self, name: str):
        return self._f.get_slice(name) if name not in self._pairs else _Slice(self, name)

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self._pairs:
            return self._f.get_tensor(name)
        packed, scale = (self._f.get_tensor(n) for n in self._pairs[name])
        if name in self._packed:
            check_pair(packed, scale)
            return torch.cat([packed, scale], dim=-1)
        return dequantize_mxfp4(packed, scale)

    def metadata(self):
        return self._f.metadata()


class safe_open:  # noqa: N801 (safetensors' name, so the loader swaps one import)
    """safetensors.safe_open with MXFP4 pairs shown as `.weight` tensors: dequantised, or routed
    experts as packed rows with `packed_experts` (the loader passes `pack_at_load(mode)`)."""

    def __init__(self, filename, framework: str = "pt", device: str = "cpu", packed_experts: bool = False):
        self._cm = _safe_open(filename, framework, device=device)
        self._packed_experts = packed_experts

    def __enter__(self) -> _MxFp4File:
        return _MxFp4File(self._cm.__enter__(), self._packed_experts)

    def __exit__(self, *exc) -> None:
        self._cm.__exit__(*exc)


def random_mxfp4(E: int, N: int, K: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [E, N, K/2] uint8, scale [E, N, K/32] uint8) on the generator's device: uniform
    random E2M1 codes, E8M0 exponents 127 - log2(sqrt K) - {1..3}, which keep a product with unit
    activations near unit size (benchmarks and tests of released MXFP4 shapes)."""
    dev = generator.device
    packed = torch.randint(0, 256, (E, N, K // 2), generator=generator, device=dev, dtype=torch.int32)
    base = 127 - round(0.5 * math.log2(K)) - 1
    scale = base - torch.randint(0, 3, (E, N, K // GROUP), generator=generator, device=dev)
    return packed.to(torch.uint8), scale.to(torch.uint8)


class Mxfp4Experts(nn.Module):
    """E routed experts kept in MXFP4, stacked as StackedExperts is (gate rows then up rows):
    buffers gate_up_proj [E, 2I, H/2 + H/32] and down_proj [E, H, I/2 + I/32], uint8, each row
    the K/2 code bytes (column 2i in the low nibble) then the K/32 E8M0 scales. Being buffers of
    an integer dtype, a model's `.to(dtype)` leaves them as they are.

    forward(x [M, H], weights [M, k] fp32, ids [M, k] int64) -> [M, H] in x.dtype: the MXFP4
    fused-MoE kernels (hyla.ops.triton.fused_moe_mxfp4: decoded per K tile in registers) where
    hyla.ops.dispatch picks Triton (CUDA, no grad, not fp64), else the experts dequantised to
    x's dtype and the torch grouped GEMMs (hyla.ops.moe.moe_experts_torch)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: GatedActivation):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation
        self.register_buffer("gate_up_proj", torch.zeros(num_experts, 2 * intermediate_size, row_bytes(hidden_size),
                                                         dtype=torch.uint8))
        self.register_buffer("down_proj", torch.zeros(num_experts, hidden_size, row_bytes(intermediate_size),
                                                      dtype=torch.uint8))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def w13(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed [E, 2I, H/2], scale [E, 2I, H/32]): views of gate_up_proj."""
        return _split(self.gate_up_proj, self.hidden_size)

    def w2(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed [E, H, I/2], scale [E, H, I/32]): views of down_proj."""
        return _split(self.down_proj, self.intermediate_size)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) in dtype (exact in bf16 / fp32)."""
        return dequantize_mxfp4(*self.w13(), dtype), dequantize_mxfp4(*self.w2(), dtype)

    @torch.no_grad()
    def to_fp8(self):
        """These experts as hyla.layers.fp8_moe.Fp8StackedExperts (same activation, same device),
        converted one expert at a time: dequantised (exact, fp32), then block-quantised with
        power-of-two scales (see the module docstring for when that is exact)."""
        from hyla.layers.fp8_moe import Fp8StackedExperts
        from hyla.ops.fp8 import block_quantize, quantize_gate_up

        with torch.device(self.gate_up_proj.device):
            out = Fp8StackedExperts(self.num_experts, self.hidden_size, self.intermediate_size,
                                    activation=self.activation)
        (p13, s13), (p2, s2) = self.w13(), self.w2()
        for e in range(self.num_experts):
            q, s = quantize_gate_up(dequantize_mxfp4(p13[e], s13[e]), power_of_two=True)
            out.gate_up_proj[e].copy_(q)
            out.gate_up_proj_scale_inv[e].copy_(s)
            q, s = block_quantize(dequantize_mxfp4(p2[e], s2[e]), power_of_two=True)
            out.down_proj[e].copy_(q)
            out.down_proj_scale_inv[e].copy_(s)
        return out

    def load_packed(self, w13: tuple[torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Fill from (packed, scale) pairs of the shapes `w13()` / `w2()` return (tests, converters)."""
        with torch.no_grad():
            for dst, (packed, scale) in ((self.gate_up_proj, w13), (self.down_proj, w2)):
                check_pair(packed, scale)
                dst.copy_(torch.cat([packed, scale], dim=-1))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from hyla.ops import dispatch

        if dispatch.backend_for(x, x, [x], heads=False) == "triton":
            from hyla.ops.triton.fused_moe_mxfp4 import fused_moe_mxfp4

            return fused_moe_mxfp4(x, *self.w13(), *self.w2(), weights, ids, activation=self.activation)
        from hyla.ops.moe import moe_experts_torch

        w13, w2 = self.dequantized(x.dtype)
        return moe_experts_torch(x, w13, w2, weights, ids, self.activation)


def _split(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rows[..., : k // 2], rows[..., k // 2:]


def check_pair(packed: torch.Tensor, scale: torch.Tensor) -> None:
    """packed uint8 [..., N, K/2] and scale uint8 [..., N, K/32] of one weight; ValueError if not."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 expects uint8 weight_packed and weight_scale, got {packed.dtype}, {scale.dtype}")
    k = 2 * packed.shape[-1]
    if scale.shape[:-1] != packed.shape[:-1] or scale.shape[-1] * GROUP != k:
        raise ValueError(f"MXFP4 scale {tuple(scale.shape)} does not hold one exponent per {GROUP} columns "
                         f"of a {tuple(packed.shape[:-1]) + (k,)} weight")
