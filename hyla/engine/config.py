"""EngineConfig: every engine knob in one validated dataclass."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from hyla.engine.cache_tiers import CHECKPOINT_DTYPES

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(value, name: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in ("auto",):
        return None
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(f"{name} must be one of {sorted(_DTYPES)} or 'auto', got {value!r}")


@dataclass
class SpecConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    rollback: str = "slots"

    @classmethod
    def parse(cls, raw: dict | str | SpecConfig | None) -> SpecConfig | None:
        """From a dict (or its JSON text, as the CLI passes it); ValueError names what is wrong."""
        if raw is None or isinstance(raw, SpecConfig):
            return raw
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config must be a dict")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "rollback"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}")
        cfg = cls(**{"method": raw.get("method"), "num_speculative_tokens": raw.get("num_speculative_tokens"),
                     **{k: v for k, v in raw.items() if k not in ("method", "num_speculative_tokens")}})
        if cfg.method not in ("ngram", "draft_model", "mtp"):
            raise ValueError(f"speculative_config method must be 'ngram', 'draft_model' or 'mtp', got {cfg.method!r}")
        k = cfg.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..16, got {k!r}")
        lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if cfg.rollback not in ("slots", "replay"):
            raise ValueError(f"rollback must be 'slots' or 'replay', got {cfg.rollback!r}")
        if cfg.method == "draft_model" and not (isinstance(cfg.model, str) and cfg.model):
            raise ValueError("method 'draft_model' needs 'model': the draft checkpoint's path")
        if cfg.method == "mtp" and cfg.model is not None:
            raise ValueError("method 'mtp' takes no 'model': the head is read from the target checkpoint")
        return cfg


@dataclass
class EngineConfig:
    """model: a checkpoint directory, a bundled model's name or a Hugging Face Hub id (`org/name`,
    resolved in the local Hugging Face cache, downloaded when missing: hyla.models.hub);
    revision: the Hub branch, tag or commit (Hub ids only). dtype / device: model weights
    (None = checkpoint dtype on CPU, bf16 on CUDA; device None = CUDA when available). max_num_seqs: running requests at most
    (clamped to the state slots the budget holds). max_num_batched_tokens: tokens per step
    (prefill chunks + decodes). max_model_len: prompt + output tokens per request (None = the
    model's limit). memory_budget: bytes for KV pages + state slots (None = derived: on
    CUDA gpu_memory_utilization (default 0.9) of the device's total memory less what is in use and
    a profiled worst-case step, hyla.engine.memory_profile; on the CPU pools.size_pools). state_dtype: recurrent state precision (fp32 default, bf16 option).
    enable_prefix_caching: reuse KV pages + state checkpoints across requests (prefix_cache.py);
    checkpoint_interval: also export a state every that many prompt tokens (default off).
    speculative_config: a dict (or its JSON text) of SpecConfig's fields, or None.
    tensor_parallel_size: ranks the model is split over (hyla.parallel: worker processes started
    by the engine, one per device; memory_budget is then per rank); enable_expert_parallel:
    whole experts per rank instead of every expert split along its width. load_format "dummy":
    random weights, no safetensors read (benchmarks of released shapes from their config.json).
    generation_config: "auto" = the checkpoint's generation_config.json (sampling defaults for
    requests that leave them unset, and its EOS ids), "vllm" = none of it, or another directory
    holding a generation_config.json (vLLM's `--generation-config`; hyla.engine.generation_config).
    mamba_ssm_cache_dtype: vLLM's name for state_dtype ("auto" = float32). checkpoint_dtype "int8":
    prefix-cache state checkpoints stored with int8 rows and fp32 scales (hyla.engine.checkpoint_codec),
    in the memory the checkpoints' state slots would take. host_cache_bytes: a host-memory tier
    that receives what the prefix cache's device tier evicts (hyla.engine.cache_tiers).
    quantization: None, or "fp8" (vLLM's `--quantization fp8`): block-quantise a bf16 checkpoint's
    projections and experts to FP8 while loading; an FP8 checkpoint is read as FP8 either way
    (hyla.models.fp8; another value, or "fp8" on another quantised format, is a ValueError).
    fp8_weights: how FP8 weights load: "auto" (FP8 modules on CUDA, dequantised elsewhere), "fp8"
    (FP8 modules on any device: the W8A8 arithmetic, also on the CPU) or "dequantized"
    (hyla.models.fp8_loading). mxfp4_experts: how MXFP4 routed experts load: "auto" (packed on CUDA),
    "packed", "dequantized" or "fp8" (converted to block FP8 at load) (hyla.models.mxfp4).
    backend: the ops' kernels for the whole process, applied when the engine starts
    (hyla.ops.dispatch.set_backend): "auto" (Triton on CUDA, torch elsewhere), "torch" or
    "triton"; None keeps the process's choice (the HYLA_BACKEND environment variable, else auto).
    kv_cache_dtype: "auto" (attention KV pages in the model dtype), or "fp8" / "fp8_e4m3" (vLLM's
    `--kv-cache-dtype fp8`): MLA latents / GQA keys and values stored in e4m3 with per-token fp32
    scales, about half the bytes per token of bf16, so the same budget holds about twice the pages
    (hyla.ops.kv_fp8); anything else, vLLM's "fp8_e5m2" and "fp8_inc" included, is a ValueError.
    async_scheduling (vLLM's `--async-scheduling`): when the next decode step is certain to run the
    same requests, launch it before this step's tokens are read (hyla.engine.overlap; MTP's fused
    steps likewise, hyla.engine.spec.mtp.overlap), so the host's per-step work runs beside the GPU;
    it applies where the decode steps run in CUDA graphs; output is the same either way.
    cuda_graph_sizes (vLLM's `--cuda-graph-sizes`): the batch sizes decode CUDA graphs are
    captured for (at startup, unless speculating: hyla.engine.cuda_graph; a batch runs in the
    smallest size that holds it, a larger one eagerly); None = 1, 2, 4, then multiples of 8 up to
    max_num_seqs.
    prefill_graph_max_tokens: prefill steps of up to this many tokens run their token-wise spans
    (projections, norms, FFN / MoE) as CUDA graphs per token bucket, captured at startup, with the
    convs, chunks and attention eager between them (hyla.engine.prefill_graphs; models whose
    class sets `piecewise_prefill`: Kimi-Linear, Qwen3-Next, Qwen3.5); 0 = every prefill step
    eager; None = PREFILL_GRAPH_DEFAULT_TOKENS where the decode steps run in CUDA graphs (one CUDA
    device, no enforce_eager) and the model opts in, else 0. Given explicitly on the CPU, the
    spans run over the same padded buffers without graphs (what the tests check).
    kernel_warmup: on CUDA with one device, run the prefill-shaped steps a server meets once at
    startup, so that Triton compiles their kernels before the first request rather than while
    it serves (hyla.engine.kernel_warmup); False skips it (a few seconds when the machine's Triton
    cache holds them).
    step_log: a file path: one JSON line per engine step (its time, wall time, decode rows and
    prefill chunks by request id: hyla.engine.step_log), for taking a served run's latencies apart;
    None writes nothing."""

    model: str
    dtype: torch.dtype | str | None = None
    device: str | torch.device | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # resolved in __post_init__: the value the engine uses
    memory_budget: int | None = None
    enable_prefix_caching: bool = False
    speculative_config: dict | str | SpecConfig | None = None  # parsed in __post_init__ into a SpecConfig
    enforce_eager: bool = False
    seed: int = 0
    state_dtype: torch.dtype | str = torch.float32
    page_size: int = 16
    checkpoint_interval: int | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    load_format: str = "auto"
    quantization: str | None = None  # "fp8": block-quantise a bf16 checkpoint while loading (hyla.models.fp8)
    kv_cache_dtype: str = "auto"  # or "fp8" / "fp8_e4m3": e4m3 KV pages with per-token scales (hyla.ops.kv_fp8)
    fp8_weights: str = "auto"  # or "fp8" / "dequantized": FP8 weights in FP8 modules or dequantised
    mxfp4_experts: str = "auto"  # or "packed" / "dequantized" / "fp8": MXFP4 experts packed, dequantised or block FP8
    revision: str | None = None
    generation_config: str = "auto"
    scheduling_policy: str = "fcfs"  # or "priority": SamplingParams.priority orders the waiting queue
    gpu_memory_utilization: float = 0.9
    mamba_ssm_cache_dtype: str | None = None  # vLLM's name for state_dtype: "auto" (float32), "float32", "bfloat16"
    checkpoint_dtype: str = "auto"  # "int8": prefix-cache state checkpoints stored int8 (hyla.engine.checkpoint_codec)
    host_cache_bytes: int = 0  # a host-memory tier under the prefix cache, in bytes (0: none)
    backend: str | None = None  # "auto" / "torch" / "triton": the ops' backend (None: HYLA_BACKEND's, else auto)
    async_scheduling: bool = True  # launch a decode step before the last one's tokens are read (hyla.engine.overlap)
    cuda_graph_sizes: list[int] | None = None  # decode graphs' batch sizes (None: 1, 2, 4, 8, 16, ... max_num_seqs)
    prefill_graph_max_tokens: int | None = None  # prefill steps up to N tokens: spans as CUDA graphs (0: off; None: auto)
    kernel_warmup: bool = True  # on CUDA, one device: prefill-shaped steps compile their kernels before serving
    step_log: str | None = None  # a JSON-lines trace of every engine step (hyla.engine.step_log)
    model_limit: int = field(init=False, default=0)  # the checkpoint's max_position_embeddings (or 2^20)

    def __post_init__(self):
        """Validate and resolve every field; reads config.json files (the target's, the draft
        model's), never a weight, so a bad configuration fails before any model loads."""
        self.dtype = parse_dtype(self.dtype, "dtype")
        self.state_dtype = parse_dtype(self.state_dtype, "state_dtype") or torch.float32
        self._resolve_cache_fields()
        if self.state_dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"state_dtype must be float32, bfloat16 or float64, got {self.state_dtype}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        g = self.prefill_graph_max_tokens
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 0):
            raise ValueError(f"prefill_graph_max_tokens must be an integer >= 0, got {g!r}")
        if g and self.enforce_eager:
            raise ValueError("prefill_graph_max_tokens asks for CUDA graphs, which enforce_eager turns off")
        if g and self.tensor_parallel_size > 1:
            raise ValueError("prefill_graph_max_tokens is for one device (tensor_parallel_size 1)")
        sizes = self.cuda_graph_sizes
        if sizes is not None and (not isinstance(sizes, (list, tuple)) or not sizes or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes)):
            raise ValueError(f"cuda_graph_sizes must be a non-empty list of integers >= 1, got {sizes!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        if self.memory_budget is not None and (not isinstance(self.memory_budget, int) or self.memory_budget <= 0):
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}")
        if self.checkpoint_interval is not None and (not isinstance(self.checkpoint_interval, int)
                                                     or self.checkpoint_interval < 1):
            raise ValueError(f"checkpoint_interval must be a positive integer, got {self.checkpoint_interval!r}")
        if self.step_log is not None and (not isinstance(self.step_log, (str, os.PathLike)) or not str(self.step_log)):
            raise ValueError(f"step_log must be a file path, got {self.step_log!r}")
        if self.backend is not None and self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {self.backend!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        from hyla.ops.kv_fp8 import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype, "kv_cache_dtype")
        from hyla.models.fp8_loading import check_fp8_weights
        from hyla.models.mxfp4 import check_experts_mode

        check_fp8_weights(self.fp8_weights)
        check_experts_mode(self.mxfp4_experts)
        if self.mxfp4_experts in ("packed", "fp8") and self.tensor_parallel_size > 1:
            # the parallel plans cut the logical [N, K] expert weights (hyla.models.mxfp4)
            raise ValueError(f"mxfp4_experts={self.mxfp4_experts!r} runs on one device; with tensor_parallel_size > 1 use "
                             "'auto' (dequantised on the ranks) or 'dequantized'")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available")
        self.speculative_config = SpecConfig.parse(self.speculative_config)
        from hyla.models.hub import resolve_model
        from hyla.models.loader import load_config

        self.model = resolve_model(self.model, self.revision)
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding generation_config.json, "
                             f"got {self.generation_config!r}")

        target = load_config(self.model)
        from hyla.models.config import read_config_json
        from hyla.models.fp8 import check_quantization, quantization_config_of

        check_quantization(self.quantization, quantization_config_of(read_config_json(self.model)))
        self._check_parallel(target)
        self.model_limit = getattr(target, "max_position_embeddings", None) or 1 << 20
        # Without an explicit max_model_len: the model's limit, but at most 8192 tokens so that the
        # default pools stay small (raise it with max_model_len).
        # An explicit one above the model's limit is refused, as vLLM does: positions past it were never
        # trained (rope scaling is the checkpoint's to declare).
        if self.max_model_len and self.max_model_len > self.model_limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({self.model_limit})")
        self.max_model_len = self.max_model_len or min(self.model_limit, 8192)
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model":
            try:
                spec.model = resolve_model(spec.model)
                draft = load_config(spec.model)
            except (OSError, ValueError) as e:
                raise ValueError(f"speculative_config model {spec.model!r}: {e}") from None
            if draft.vocab_size != target.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
                                 f"({target.vocab_size}): it must share the tokenizer")
        if spec is not None and spec.method == "mtp":
            from hyla.models.loader import weight_files

            if not any(name.startswith("mtp.") for name in weight_files(self.model)):
                raise ValueError(f"speculative method 'mtp' needs a checkpoint with a multi-token-prediction head; "
                                 f"{self.model} has no `mtp.*` tensors")
            spec.model = self.model  # the drafter reads the head from there

    def _resolve_cache_fields(self) -> None:
        """mamba_ssm_cache_dtype (vLLM's flag; sets state_dtype), checkpoint_dtype, host_cache_bytes."""
        name = self.mamba_ssm_cache_dtype
        if name is not None:
            states = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}
            if name not in states:
                raise ValueError(f"mamba_ssm_cache_dtype must be one of {sorted(states)}, got {name!r} "
                                 "(the recurrent state runs in float32 or bfloat16)")
            if self.state_dtype != torch.float32 and self.state_dtype != states[name]:
                raise ValueError(f"mamba_ssm_cache_dtype={name!r} contradicts state_dtype={self.state_dtype}")
            self.state_dtype = states[name]
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"checkpoint_dtype must be one of {CHECKPOINT_DTYPES}, got {self.checkpoint_dtype!r}")
        h = self.host_cache_bytes
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"host_cache_bytes must be a number of bytes >= 0, got {h!r}")
        if (self.checkpoint_dtype != "auto" or h) and not self.enable_prefix_caching:
            raise ValueError("checkpoint_dtype='int8' and host_cache_bytes store prefix-cache entries: "
                             "they need enable_prefix_caching")

    def _check_parallel(self, target) -> None:
        """tensor_parallel_size: enough devices, a family with a plan, sizes it divides (the
        ValueError names the config field; an MTP head's layer has the target's attention and
        MLP sizes, so it splits wherever the target does)."""
        n = self.tensor_parallel_size
        if n == 1:
            return
        if self.device.type == "cuda" and torch.cuda.device_count() < (self.device.index or 0) + n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} CUDA devices from {self.device}, "
                             f"{torch.cuda.device_count()} are visible")
        from hyla.parallel.plans import check_parallel

        check_parallel(target, n, self.enable_expert_parallel)

    @property
    def slots_per_seq(self) -> int:
        """State slots a running request holds: 1 + k with speculative "slots" rollback, else 1."""
        spec = self.speculative_config
        return 1 + spec.num_speculative_tokens if spec is not None and spec.rollback == "slots" else 1
