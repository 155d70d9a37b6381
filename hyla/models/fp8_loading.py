"""Loading FP8 weights (hyla.models.fp8): a released FP8 checkpoint, or a bf16 one quantised while
it loads (`quantization="fp8"`), into FP8 modules or into the ordinary model.

Two ways a model holds them (`fp8_weights`, an argument of hyla.models.loader.load_model and a
field of EngineConfig, chooses; `mxfp4_experts` does the same for MXFP4):

- FP8 modules (`auto` on CUDA, `fp8` on any device: the CPU tests run this path through the torch
  definitions or Triton's interpreter): the meta model's projections become
  hyla.layers.fp8_linear.Fp8Linear and its routed experts hyla.layers.fp8_moe.Fp8StackedExperts,
  the checkpoint's `<m>.weight` (e4m3) and `<m>.weight_scale_inv` are copied as they are (per
  expert tensors into their slices of the stacked ones), or, online, each bf16 weight is
  quantised on the target device as it is read (one tensor at a time: never a bf16 copy of the
  model);
- dequantised (`auto` off CUDA, `dequantized`): the ordinary model; each (weight, scale) pair is
  read as one `<m>.weight`, q x s in fp32 then cast to the model dtype by the copy; online, each
  chosen weight is quantised and dequantised as it is read, so the CPU model computes with the
  very weights the FP8 path holds.

Which modules are FP8: for a released checkpoint, those whose weights carry scales (and that
hyla can run in FP8: nn.Linear projections and StackedExperts, minus the projections whose
weight other code reads directly, RAW_WEIGHT_MODULES); other scaled tensors are dequantised. For
online quantisation, hyla.models.fp8's rule (every nn.Linear and the experts, not
modules_to_not_convert, not lm_head).

`Fp8View` wraps an open safetensors file (hyla.models.loader opens every file through
`LoadPlan.open`): it checks the FP8 tensors from the header (dtypes, scale shapes, partial edge
blocks) before any weight memory exists, then shows the names and tensors the model takes.
`Fp8Shard` wraps a tensor-parallel plan (hyla.parallel.tensor.ShardPlan): a scale tensor is
cut along with its weight, block for block, which needs the weight's cut to fall on multiples of
128 (ValueError otherwise).

`mark_fp8_producers` (hyla.models.loader runs it on every model it returns) asks the kernels that
produce the FP8 modules' inputs (norms, gated output norms, the MLP activation) to also write those
inputs' block-FP8 form, so that the FP8 GEMMs launch no activation quantiser of their own
(hyla.ops.fp8_activation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from hyla.layers.fp8_linear import Fp8Linear
from hyla.layers.fp8_moe import Fp8StackedExperts
from hyla.layers.moe import StackedExperts
from hyla.models.fp8 import (BLOCK, SCALE_SUFFIX, Fp8Config, block_dequantize, block_quantize, scale_shape,
                             skipped)
from hyla.ops.fp8 import dequantize_gate_up, quantize_gate_up

MODES = ("auto", "fp8", "dequantized")
# Projections whose weight is read directly, not only called: the MLA absorbed decode folds
# kv_b_proj's weight into the queries (vLLM dequantises it too), Qwen3.5's MTP head sizes its KV
# pools from fc's weight, Kimi K3's attention residuals score with their projections' weights.
# They stay in the model dtype (dequantised when the checkpoint has them in FP8).
RAW_WEIGHT_MODULES = re.compile(r"(^|\.)(kv_b_proj|fc|\w+_res_proj)$")
_FP8_NAMES = ("F8_E4M3",)
_SCALE_DTYPES = ("F32", "BF16", "F16")


# Who feeds whom, the producer -> consumer pairs `mark_fp8_producers` follows: inside one module,
# the sub-module named first passes its output to the one named second ("" is the module itself:
# an MLP's activation feeds its down_proj). Every family names these alike: the decoder layers'
# pre-norms feed the token mixer and the MLP / MoE, KDA's o_norm its o_proj, GDN's norm its out_proj.
FP8_FEEDS = (("input_layernorm", "token_mixer"), ("post_attention_layernorm", "mlp"),
             ("post_attention_layernorm", "block_sparse_moe"), ("o_norm", "o_proj"), ("norm", "out_proj"),
             ("", "down_proj"))


def check_fp8_weights(mode: str) -> str:
    """`mode` if it is one of MODES (module docstring), else ValueError naming fp8_weights."""
    if mode not in MODES:
        raise ValueError(f"fp8_weights must be one of {MODES}, got {mode!r}")
    return mode


def fp8_modules_on(device: torch.device, mode: str = "auto") -> bool:
    """Whether FP8 weights load into FP8 modules on `device` (else dequantised); mode: fp8_weights."""
    mode = check_fp8_weights(mode)
    return mode == "fp8" or (mode == "auto" and torch.device(device).type == "cuda")


def scale_name(weight_name: str) -> str:
    """`<m>.weight` -> `<m>.weight_scale_inv`; stacked `experts.gate_up_proj` -> `..._scale_inv`."""
    return weight_name + SCALE_SUFFIX


def _module_of(tensor_name: str) -> str:
    """The module holding a model tensor: `a.b.weight` -> `a.b`, `x.experts.gate_up_proj` -> `x.experts`."""
    return tensor_name.rsplit(".", 1)[0]


def _eligible_linear(name: str, module: nn.Module, model: nn.Module) -> bool:
    if type(module) is not nn.Linear or RAW_WEIGHT_MODULES.search(name):
        return False
    lm_head = getattr(model, "lm_head", None)
    tied = module is lm_head and lm_head.weight is model.model.embed_tokens.weight
    return not tied


@dataclass
class LoadPlan:
    """How one load treats FP8: `config` (the checkpoint's or the online one), `prequantized`
    (the checkpoint holds FP8 tensors), `modules` (FP8 modules built, else dequantised),
    `fp8_targets` (model tensors, in this rank's names, filled from FP8 data: converted modules'
    weights, or online the chosen weights), `target_of` (checkpoint name -> model tensor,
    hyla.models.loader's mapping), `device` (where online quantisation runs)."""

    config: Fp8Config
    prequantized: bool
    modules: bool
    target_of: Callable[[str], str | None]
    device: torch.device
    fp8_targets: set[str] = field(default_factory=set)
    weight_shapes: dict[str, tuple] = field(default_factory=dict)  # checkpoint weight -> full shape

    def open(self, f) -> Fp8View:
        return Fp8View(f, self)

    def weight_map(self, files: dict[str, str]) -> dict[str, str]:
        """{checkpoint tensor: file} as the views show them: a dequantised pair's scale gone (its
        weight carries it), an online FP8 weight's synthesised scale in the weight's file."""
        out = {}
        for name, file in files.items():
            if name.endswith(SCALE_SUFFIX) and self.prequantized:
                weight = name[: -len(SCALE_SUFFIX)]
                if not (self.modules and self.is_fp8_target(weight)):
                    continue
            out[name] = file
            if not self.prequantized and self.modules and self.is_fp8_target(name):
                out[scale_name(name)] = file
        return out

    def is_fp8_target(self, checkpoint_name: str) -> bool:
        return self.target_of(checkpoint_name) in self.fp8_targets


def convert_model(model: nn.Module, plan: LoadPlan, checkpoint_names) -> None:
    """Choose the FP8 modules of the meta `model` (plan.fp8_targets) and, when plan.modules, swap
    them in: Fp8Linear for nn.Linear, Fp8StackedExperts for StackedExperts. checkpoint_names: the
    checkpoint's tensor names (a released checkpoint's scaled weights decide)."""
    chosen: set[str] = set()  # module names
    if plan.prequantized:
        for name in checkpoint_names:
            target = plan.target_of(name[: -len(SCALE_SUFFIX)]) if name.endswith(SCALE_SUFFIX) else None
            if target is not None:
                chosen.add(_module_of(target))
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if _eligible_linear(name, module, model):
            take = name in chosen if plan.prequantized else not skipped(name, plan.config.modules_to_not_convert)
            if take:
                plan.fp8_targets.add(f"{name}.weight")
                if plan.modules:
                    model.set_submodule(name, Fp8Linear.like(module))
        elif type(module) is StackedExperts:
            take = name in chosen if plan.prequantized else not skipped(name, plan.config.modules_to_not_convert)
            if take:
                plan.fp8_targets.update({f"{name}.gate_up_proj", f"{name}.down_proj"})
                if plan.modules:
                    model.set_submodule(name, Fp8StackedExperts.like(module))


def _holds_fp8(module: nn.Module) -> bool:
    return any(isinstance(m, (Fp8Linear, Fp8StackedExperts)) for m in module.modules())


def mark_fp8_producers(model: nn.Module) -> None:
    """Set `fp8_output` on every producer (a module with that attribute: hyla.layers.norm's norms,
    hyla.layers.mlp.MLP) whose output feeds a module holding FP8 weights (an Fp8Linear or
    Fp8StackedExperts in it), along FP8_FEEDS; its Triton kernel then also writes the block-FP8
    form those weights' GEMMs read (hyla.ops.fp8_activation). A consumer holding several modules
    (a token mixer) counts as FP8 when any of them is: an unneeded form costs a write in a launch
    that runs anyway, a missing one a launch. Nothing changes for a model without FP8 weights or
    off the Triton path."""
    for parent in model.modules():
        for producer_name, consumer_name in FP8_FEEDS:
            producer = getattr(parent, producer_name, None) if producer_name else parent
            consumer = getattr(parent, consumer_name, None)
            if hasattr(producer, "fp8_output") and isinstance(consumer, nn.Module) and _holds_fp8(consumer):
                producer.fp8_output = True


class _Slice:
    """What `get_slice` returns for a tensor the view computes: its shape, and indexing (a
    tensor-parallel read cuts the computed tensor)."""

    def __init__(self, view: Fp8View, name: str):
        self.view, self.name = view, name

    def get_shape(self) -> list[int]:
        return list(self.view.shape(self.name))

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index) -> torch.Tensor:
        return self.view.get_tensor(self.name)[index]


class Fp8View:
    """An open safetensors file as the FP8 load plan shows it (see the module docstring): released
    pairs passed through (FP8 modules) or dequantised into `<m>.weight`; online, chosen bf16
    weights quantised into pairs or quantised-and-dequantised. Header checks run on opening."""

    def __init__(self, f, plan: LoadPlan):
        self._f, self.plan = f, plan
        names = list(f.keys())
        present = set(names)
        self._dequant: dict[str, str] = {}  # weight name -> its scale, read as one dequantised tensor
        self._online: set[str] = set()  # bf16 weights quantised as they are read
        self._scales_of: dict[str, str] = {}  # synthesised scale name -> its weight (online FP8 modules)
        self._last: tuple[str, torch.Tensor, torch.Tensor] | None = None  # (weight, q, s) just quantised
        for name in names:
            if name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                if weight not in present:
                    raise ValueError(f"FP8 scale {name} has no weight {weight} in the same file")
                self._check_pair(weight, name)
                plan.weight_shapes[weight] = self._raw_shape(weight)
                if not (plan.modules and plan.is_fp8_target(weight)):
                    self._dequant[weight] = name
            elif self._raw_dtype(name) in _FP8_NAMES and scale_name(name) not in present:
                raise ValueError(f"FP8 tensor {name} has no {scale_name(name)} beside it")
        if not plan.prequantized:
            for name in names:
                if plan.is_fp8_target(name) and len(self._raw_shape(name)) in (2, 3):
                    self._online.add(name)
                    plan.weight_shapes[name] = self._raw_shape(name)
                    if plan.modules:
                        self._scales_of[scale_name(name)] = name

    # -- headers ----------------------------------------------------------------------------------
    def _raw_shape(self, name: str) -> tuple:
        return tuple(self._f.get_slice(name).get_shape())

    def _raw_dtype(self, name: str) -> str:
        sl = self._f.get_slice(name)
        return sl.get_dtype() if hasattr(sl, "get_dtype") else "F32"

    def _check_pair(self, weight: str, scale: str) -> None:
        wd, sd = self._raw_dtype(weight), self._raw_dtype(scale)
        if wd not in _FP8_NAMES:
            raise ValueError(f"FP8 weight {weight} is stored as {wd}; quant_method fp8 expects F8_E4M3 beside "
                             f"its {scale}")
        if sd not in _SCALE_DTYPES:
            raise ValueError(f"FP8 scale {scale} is stored as {sd}; expected one of {_SCALE_DTYPES}")
        w, s = self._raw_shape(weight), self._raw_shape(scale)
        want = w[:-2] + scale_shape(*w[-2:], BLOCK) if len(w) >= 2 else None
        if want is None or s != want:
            raise ValueError(f"FP8 scale {scale} has shape {list(s)}; its weight {weight} {list(w)} needs "
                             f"{list(want) if want else 'a matrix'} (one scale per {BLOCK}x{BLOCK} block, the last "
                             f"ones partial)")

    # -- the safetensors interface the loader uses -------------------------------------------------
    def keys(self) -> list[str]:
        hidden = set(self._dequant.values())
        out = [n for n in self._f.keys() if n not in hidden]
        # each synthesised scale right after its weight: the weight's quantisation is reused
        extra = {w: s for s, w in self._scales_of.items()}
        return [m for n in out for m in ((n, extra[n]) if n in extra else (n,))]

    def _gate_up(self, weight: str) -> bool:
        """A fused [E, 2I, H] gate/up tensor: its halves are blocked apart (hyla.layers.fp8_moe)."""
        return len(self._raw_shape(weight)) == 3 and (self.plan.target_of(weight) or "").endswith("gate_up_proj")

    def shape(self, name: str) -> tuple:
        if name in self._scales_of:
            w = self._raw_shape(self._scales_of[name])
            if self._gate_up(self._scales_of[name]):
                return (w[0], 2 * -(-(w[1] // 2) // BLOCK), -(-w[2] // BLOCK))
            return w[:-2] + scale_shape(*w[-2:])
        return self._raw_shape(name)

    def get_slice(self, name: str):
        if name in self._scales_of or name in self._dequant or name in self._online:
            return _Slice(self, name)
        return self._f.get_slice(name)

    def _quantized(self, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] != weight:
            w = self._f.get_tensor(weight).to(self.plan.device)
            self._last = (weight, *(quantize_gate_up(w) if self._gate_up(weight) else block_quantize(w)))
        return self._last[1], self._last[2]

    def get_tensor(self, name: str) -> torch.Tensor:
        if name in self._dequant:
            return block_dequantize(self._f.get_tensor(name), self._f.get_tensor(self._dequant[name]).float())
        if name in self._scales_of:
            return self._quantized(self._scales_of[name])[1]
        if name in self._online:
            q, s = self._quantized(name)
            if self.plan.modules:
                return q
            return dequantize_gate_up(q, s, torch.float32) if self._gate_up(name) else block_dequantize(q, s)
        t = self._f.get_tensor(name)
        return t.float() if name.endswith(SCALE_SUFFIX) else t

    def metadata(self):
        return self._f.metadata()


class Fp8Shard:
    """A tensor-parallel plan with FP8 scales cut along with their weights (see the module
    docstring); everything else is the wrapped plan's."""

    def __init__(self, shard, plan: LoadPlan):
        self._shard, self._plan = shard, plan

    def __getattr__(self, name):
        return getattr(self._shard, name)

    def _scale_cut(self, name: str, full: tuple):
        weight = name[: -len(SCALE_SUFFIX)]
        wshape = self._plan.weight_shapes.get(weight)
        if wshape is None:
            return None
        cut = self._shard.cut(weight, wshape)
        if cut is None:
            return None
        from hyla.parallel.tensor import Cut

        size = wshape[cut.dim]
        ranges = []
        for a, b in cut.ranges:
            for edge in (a, b):
                if edge % BLOCK and edge != size:
                    raise ValueError(
                        f"tensor_parallel_size={self._shard.world} cuts FP8 weight {weight} {list(wshape)} at "
                        f"{edge} along dim {cut.dim}, not a multiple of the {BLOCK}-wide scale blocks "
                        f"(quantization_config.weight_block_size); use fewer ranks or expert parallelism")
            ranges.append((a // BLOCK, -(-b // BLOCK)))
        pad = None if cut.pad_to is None else -(-cut.pad_to // BLOCK)
        if cut.pad_to is not None and cut.pad_to % BLOCK:
            raise ValueError(f"tensor_parallel_size={self._shard.world} pads FP8 weight {weight} to {cut.pad_to} "
                             f"rows, not a multiple of {BLOCK}")
        return Cut(cut.dim, tuple(ranges), pad, cut.zero)

    def cut(self, name: str, full: tuple):
        if name.endswith(SCALE_SUFFIX):
            return self._scale_cut(name, full)
        return self._shard.cut(name, full)

    # ShardPlan's own shape / read, run with this object's `cut` (the wrapped plan's methods would
    # call the wrapped plan's cut, which does not know the scales)
    def shape(self, name: str, full: tuple) -> tuple:
        from hyla.parallel.tensor import ShardPlan

        return ShardPlan.shape(self, name, full)

    def read(self, name: str, f) -> torch.Tensor:
        from hyla.parallel.tensor import ShardPlan

        return ShardPlan.read(self, name, f)


@torch.no_grad()
def init_random_fp8_(model: nn.Module, std: float, seed: int = 0) -> None:
    """Random FP8 modules (load_format "dummy"): each weight drawn N(0, std) in bf16 on the
    model's device, one tensor (one expert) at a time, and block-quantised there."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            dev = module.weight.device
            gen = torch.Generator(device=dev).manual_seed(seed)
            seed += 1
            module.quantize_(torch.empty(module.weight.shape, dtype=torch.bfloat16, device=dev).normal_(0.0, std,
                                                                                                         generator=gen))
        elif isinstance(module, Fp8StackedExperts):
            dev = module.gate_up_proj.device
            gen = torch.Generator(device=dev).manual_seed(seed)
            seed += 1
            for e in range(module.num_experts):
                w13 = torch.empty(module.gate_up_proj.shape[1:], dtype=torch.bfloat16, device=dev)
                w2 = torch.empty(module.down_proj.shape[1:], dtype=torch.bfloat16, device=dev)
                module.quantize_expert_(e, w13.normal_(0.0, std, generator=gen), w2.normal_(0.0, std, generator=gen))
