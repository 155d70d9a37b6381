"""LLMEngine: the incremental engine (add_request / step / abort_request), one step at a time.

    step() = schedule (Scheduler: the plan, every page / slot / copy of the step)
             -> ModelRunner.apply_transfers -> run the model (ModelRunner.execute of a plain
             StepPlan and / or a SpecDecoder verify) -> sample -> postprocess (emit, stop
             checks, freeing)

Outputs are cumulative RequestOutputs for every request that made progress in the step; a
streaming front-end diffs consecutive outputs.
"""

from __future__ import annotations

import logging
import time

import torch

from hyla.engine.cache_tiers import TierSizes, int8_entry_bytes
from hyla.engine.host_offload import STAGING_BYTES
from hyla.engine.config import EngineConfig
from hyla.engine.generation_config import read_generation_config, token_ids
from hyla.engine.kernel_warmup import warm_up_kernels
from hyla.engine.step_log import StepLog
from hyla.engine.cuda_graph import batch_buckets, startup_widths, use_cuda_graphs
from hyla.engine.memory_profile import (device_pool_budget, prefer_expandable_segments, profile_graph_bytes,
                                        profile_step_bytes)
from hyla.engine.model_runner import ModelRunner
from hyla.engine.outputs import RequestOutput
from hyla.engine.overlap import DecodeOverlap
from hyla.engine.pools import CHECKPOINT_SHARE, Pools, size_pools
from hyla.engine.prefix_cache import PrefixCache
from hyla.engine.sampler import PendingSample, prompt_logprobs, token_logprobs
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.scheduler import ScheduledBatch, Scheduler
from hyla.engine.sequence import Sequence, Status
from hyla.engine.spec.acceptance import argmax_draws
from hyla.engine.spec.decoder import SpecDecoder, make_drafter
from hyla.engine.step_plan import StepPlan
from hyla.ops import dispatch
from hyla.ops.transfer import to_device_long
from hyla.parallel.errors import TensorParallelError

log = logging.getLogger("hyla.engine")

# prefill_graph_max_tokens's default on CUDA: the steps up to 2,048 tokens, which launching bounds
# (48B shape, 12 layers, FP8, one H100: 1,024 tokens 26.9 -> 18.4 ms, 256 tokens 26.8 -> 13.2 ms,
# a returning turn of 549 after 3,072 cached 24.6 -> 17.4 ms; 2,048 tokens 28.5 -> 24.0 ms;
# BENCHMARKS.md "Prefill steps: host or device")
PREFILL_GRAPH_DEFAULT_TOKENS = 2048


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None):
        self.config = config
        if config.device.type == "cuda":
            prefer_expandable_segments()  # before anything allocates on the device
        if config.backend is not None:  # the ops' backend, for this process (and its tensor-parallel ranks)
            dispatch.set_backend(config.backend)
        # On the CPU, bf16 / fp16 matmuls are several times slower than fp32: default to fp32 there.
        dtype = config.dtype or (torch.float32 if config.device.type == "cpu" else None)
        self.workers = None  # tensor parallel: the WorkerGroup (rank 0 is this process)
        self.step_log: StepLog | None = None  # opened by _build when config.step_log names a file
        if model is None and config.tensor_parallel_size > 1:
            from hyla.parallel.runner import start_tensor_parallel

            self.workers = start_tensor_parallel(config, dtype)
            model = self.workers.model  # rank 0's shard: its pools, sizes and bytes are per rank
        try:
            self._build(config, model, tokenizer, dtype)
        except BaseException:
            self.shutdown()  # a failed start leaves no worker process and no process group behind
            raise

    def _build(self, config: EngineConfig, model, tokenizer, dtype) -> None:
        """Everything after the tensor-parallel workers started: the model, tokenizer, pools,
        runner, scheduler and drafter."""
        from hyla.models import load_model, load_tokenizer
        from hyla.models.tokenizer import has_tokenizer

        self.model = model if model is not None else load_model(config.model, dtype=dtype, device=config.device,
                                                                random_weights=config.load_format == "dummy",
                                                                quantization=config.quantization,
                                                                fp8_weights=config.fp8_weights,
                                                                mxfp4_experts=config.mxfp4_experts)
        self._set_kv_cache_dtype(config.kv_cache_dtype)  # before the pools are sized from the model's bytes
        self._log_weights()
        if tokenizer is None and has_tokenizer(config.model):
            tokenizer = load_tokenizer(config.model)  # a broken tokenizer file is an error, not "none"
        self.tokenizer = tokenizer
        self.vocab_size = self.model.config.vocab_size
        self.max_model_len = config.max_model_len  # resolved by EngineConfig
        spec_cfg = config.speculative_config
        # Speculative "slots" rollback keeps 1 + k states per request; with prefix caching,
        # checkpoints live in state slots too: at least as many again as running requests, and more
        # from a budget beyond the configuration's need (size_pools' checkpoint_share).
        per_seq = config.slots_per_seq
        extra = config.max_num_seqs if config.enable_prefix_caching else 0
        budget = config.memory_budget
        if budget is None and self.workers is not None and self.model.device.type == "cuda":
            budget = self.workers.pool_budget()  # the tightest rank's free memory
        # The drafter first: an MTP head keeps its KV in the engine's pages (one more layer per page).
        drafter = None if spec_cfg is None else make_drafter(
            spec_cfg, vocab_size=self.vocab_size, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, page_size=config.page_size, state_dtype=config.state_dtype,
            dtype=self.model.dtype, device=self.model.device, enforce_eager=config.enforce_eager)
        extra_kv = drafter.kv_bytes_per_token(self.model) if drafter is not None else 0
        later = drafter.bind_weight_bytes(self.model) if drafter is not None else 0  # loaded by bind
        if config.enable_prefix_caching and config.host_cache_bytes and self.model.device.type == "cuda":
            later += STAGING_BYTES  # buffers of the copies in flight to the host tier (host_offload)
        if budget is not None and config.memory_budget is None:  # measured free memory, before bind
            budget = max(0, budget - later)
        if config.kernel_warmup and self.model.device.type == "cuda" and self.workers is None:
            warm_up_kernels(self.model, max_num_batched_tokens=config.max_num_batched_tokens,
                            page_size=config.page_size, state_dtype=config.state_dtype,
                            kv_cache_dtype=config.kv_cache_dtype, checkpoints=config.enable_prefix_caching)
        # the prefill spans' graphs: captured before the pools are sized from the memory left
        prefill_graphs = self._prefill_graphs()
        graph_sizes = config.cuda_graph_sizes or batch_buckets(config.max_num_seqs)
        # speculative decoding decodes through verify graphs: its decode graphs stay lazy
        capture = self.workers is None and spec_cfg is None and use_cuda_graphs(self.model, config.enforce_eager)
        widths = startup_widths(self.max_model_len, config.page_size, bool(self.model.kv_bytes_per_token()),
                                len(graph_sizes))
        if budget is None and self.model.device.type == "cuda":
            step = profile_step_bytes(self.model, num_tokens=config.max_num_batched_tokens,
                                      num_logit_rows=config.max_num_seqs, page_size=config.page_size,
                                      state_dtype=config.state_dtype)
            if capture:  # the decode graphs captured below, before the pools take the rest
                step += profile_graph_bytes(self.model, batch_sizes=graph_sizes, widths=widths,
                                            page_size=config.page_size, state_dtype=config.state_dtype)
            budget = device_pool_budget(self.model.device, config.gpu_memory_utilization, step, later)
        self.kv_bytes_per_page = (self.model.kv_bytes_per_token() + extra_kv) * config.page_size
        num_slots, num_pages = size_pools(
            self.model, budget=budget, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, page_size=config.page_size, state_dtype=config.state_dtype,
            device=self.model.device, extra_slots=extra, slots_per_seq=per_seq, extra_kv_bytes_per_token=extra_kv,
            reserved_bytes=later, checkpoint_share=CHECKPOINT_SHARE if config.enable_prefix_caching else 0.0)
        tiers = TierSizes()
        if config.enable_prefix_caching:
            num_slots, tiers = self._cache_tiers(num_slots, num_pages, per_seq)
        self.pools = Pools(num_pages, num_slots, config.page_size)
        self._log_capacity(num_slots, num_pages, per_seq)
        if self.workers is not None:
            from hyla.parallel.runner import tp_runner

            self.runner = tp_runner(self.workers, num_slots, num_pages, config.page_size, config.state_dtype,
                                    config.enforce_eager, kv_cache_dtype=config.kv_cache_dtype)
        else:
            self.runner = ModelRunner(self.model, num_slots, num_pages, config.page_size, config.state_dtype,
                                      enforce_eager=config.enforce_eager, cuda_graph_sizes=graph_sizes,
                                      prefill_graphs=prefill_graphs)
            if capture:
                self._capture_graphs()
        if tiers != TierSizes():
            self.runner.attach_tiers(tiers)
        self.prefix_cache = (PrefixCache(self.pools, config.checkpoint_interval, tiers)
                             if config.enable_prefix_caching else None)
        self.scheduler = Scheduler(max(1, min(config.max_num_seqs, num_slots // per_seq)),
                                   config.max_num_batched_tokens, self.pools, self.prefix_cache, per_seq,
                                   num_speculative_tokens=spec_cfg.num_speculative_tokens if spec_cfg else 0,
                                   max_model_len=self.max_model_len, policy=config.scheduling_policy)
        self.generator = torch.Generator(self.model.device).manual_seed(config.seed)  # the sampler draws there
        self.generation_defaults = read_generation_config(
            config.model if config.generation_config in ("auto", "vllm") else config.generation_config,
            "vllm" if config.generation_config == "vllm" else "auto")
        try:
            self.default_sampling_params()
        except ValueError as e:
            raise ValueError(f"generation_config.json's sampling defaults are invalid: {e}") from None
        if self.generation_defaults.sampling:
            log.info("sampling defaults from generation_config.json for requests that leave them unset: %s "
                     "(generation_config='vllm' turns them off)", self.generation_defaults.sampling)
        self.eos_token_ids = self._eos_token_ids()
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None  # the first: xgrammar's stop
        self.requests: dict[str, Sequence] = {}
        if config.step_log:
            self.step_log = StepLog(config.step_log)
        # Counters the engine itself advances; get_metrics adds the scheduler's and the pools'.
        self.metrics = {"num_requests_finished": 0, "num_requests_aborted": 0, "num_requests_failed": 0,
                        "prompt_tokens": 0, "generation_tokens": 0, "spec_num_draft_tokens": 0, "spec_num_drafts": 0,
                        "spec_num_accepted_tokens": 0, "spec_num_verify_steps": 0, "num_steps": 0,
                        "engine_step_seconds": 0.0}  # wall time inside step(), the host's share included
        if drafter is not None and self.workers is not None:
            drafter = self.runner.shard_drafter(drafter)  # MTP: a shard of the head on every rank
        self.spec = SpecDecoder(spec_cfg, drafter, self.runner) if drafter is not None else None
        # MTP's fused greedy steps (its graph extension) in CUDA graphs: the next one launched
        # before this one is read
        self.chain = None
        overlapped = config.async_scheduling and self.workers is None and self.runner.graphs is not None
        if overlapped and self.spec is not None and self.spec.drafter.graph_extension is not None:
            from hyla.engine.spec.mtp.overlap import OverlapChain

            self.chain = OverlapChain(self, self.spec.drafter, spec_cfg.rollback)
        # plain decode steps launched before the last one's draws are read (speculation decodes
        # through verify steps instead)
        self.overlap = DecodeOverlap(self.runner, self.scheduler, self.max_model_len) if (
            overlapped and self.spec is None) else None
        self._drained: list[RequestOutput] = []  # outputs of a step collected outside `step` (drain)

    def _prefill_graphs(self):
        """PrefillGraphs for prefill steps up to prefill_graph_max_tokens (None: the default where
        decode steps run in graphs; capped by max_num_batched_tokens), captured now, before the
        pools are sized from what is left (hyla.engine.prefill_graphs); None when off."""
        from hyla.engine.prefill_graphs import PrefillGraphs
        from hyla.models.prefill_program import supports

        config, device = self.config, self.model.device
        wanted = config.prefill_graph_max_tokens
        if wanted is None:  # auto: where decode runs in graphs, for the models that opt in
            graphed = self.workers is None and use_cuda_graphs(self.model, config.enforce_eager)
            wanted = PREFILL_GRAPH_DEFAULT_TOKENS if graphed and supports(self.model) else 0
        if not wanted:
            return None
        if not supports(self.model):
            raise ValueError(f"prefill_graph_max_tokens: {type(self.model).__name__} does not run its prefill "
                             "steps in spans (Kimi-Linear, Qwen3-Next and Qwen3.5 do); leave it 0")
        limit = min(wanted, config.max_num_batched_tokens)
        start = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(device)[0]
        graphs = PrefillGraphs(self.model, limit)
        n = graphs.capture_all()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the captures' warm-up blocks: not the graphs'
            log.info("prefill graphs: %d span graphs for steps of up to %d tokens (buckets %s) captured in %.1f s, "
                     "%.2f GiB with their buffers", n, limit, graphs.buckets, time.perf_counter() - start,
                     (free - torch.cuda.mem_get_info(device)[0]) / 2**30)
        return graphs

    def _capture_graphs(self) -> None:
        """Capture the decode CUDA graphs now, not mid-serving (their memory was profiled before
        the pools were sized)."""
        if self.runner.graphs is None or not self.runner.graphs.capture:
            return
        device = self.model.device
        start, free = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        n, width = self.runner.capture_graphs(self.max_model_len)
        torch.cuda.synchronize(device)
        log.info("CUDA graphs: %d decode graphs captured in %.1f s (batch sizes %s; page widths up to %d = %d "
                 "tokens, wider on first use), %.2f GiB", n, time.perf_counter() - start,
                 self.runner.graphs.buckets, width, width * self.config.page_size,
                 (free - torch.cuda.mem_get_info(device)[0]) / 2**30)

    def _cache_tiers(self, num_slots: int, num_pages: int, per_seq: int) -> tuple[int, TierSizes]:
        """The prefix cache's storage beside the running pools -> (state slots, TierSizes).

        checkpoint_dtype "int8": the slots size_pools set aside for checkpoints (those beyond the
        running requests') become int8 entries, in the same bytes, less a few slots the step's
        prefills export into before a checkpoint is packed (best effort: an export without a slot
        is a checkpoint not filed). host_cache_bytes: split between host pages and host
        checkpoints in the proportion the device gives them."""
        cfg = self.config
        slot_bytes = self.model.state_bytes_per_slot(cfg.state_dtype)
        running = max(1, min(cfg.max_num_seqs, num_slots // per_seq))
        reserve = max(0, num_slots - running * per_seq)
        int8_entries, ckpt_bytes, device_ckpt_bytes = 0, slot_bytes, reserve * slot_bytes
        if cfg.checkpoint_dtype == "int8":
            meta = self.model.allocate_cache(1, 1, cfg.page_size, cfg.state_dtype, device="meta")
            ckpt_bytes = int8_entry_bytes(meta)
            exports = min(reserve, max(1, running // 4))
            int8_entries = (reserve - exports) * slot_bytes // ckpt_bytes
            num_slots = running * per_seq + exports
            device_ckpt_bytes = int8_entries * ckpt_bytes
            if not int8_entries:
                log.warning("checkpoint_dtype='int8': the budget leaves no memory for checkpoints beside the "
                            "running requests' state slots")
        host_pages = host_ckpts = 0
        self.checkpoint_bytes = ckpt_bytes  # one checkpoint in its device home (get_metrics)
        if cfg.host_cache_bytes:
            page_bytes = self.model.kv_bytes_per_token() * cfg.page_size
            share = device_ckpt_bytes / max(1, device_ckpt_bytes + num_pages * page_bytes)
            host_ckpts = int(cfg.host_cache_bytes * share) // ckpt_bytes
            host_pages = (cfg.host_cache_bytes - host_ckpts * ckpt_bytes) // max(1, page_bytes)
            log.info("host tier: %d KV pages + %d checkpoints (%.2f GiB of host memory)", host_pages, host_ckpts,
                     (host_pages * page_bytes + host_ckpts * ckpt_bytes) / 2**30)
        if int8_entries:
            log.info("prefix-cache checkpoints: %d int8 entries of %.2f MiB (a state slot: %.2f MiB)", int8_entries,
                     ckpt_bytes / 2**20, slot_bytes / 2**20)
        return num_slots, TierSizes(int8_entries, host_pages, host_ckpts)

    def _set_kv_cache_dtype(self, value: str) -> None:
        """Tell the model how its attention pages are stored (its allocate_cache and
        kv_bytes_per_token read it); FP8 pages on a model that cannot hold them are a ValueError."""
        from hyla.ops.kv_fp8 import is_fp8_kv

        if hasattr(self.model, "kv_cache_dtype"):
            self.model.kv_cache_dtype = value
        elif is_fp8_kv(value):
            raise ValueError(f"kv_cache_dtype={value!r}: {type(self.model).__name__} has no FP8 KV pages")

    def _log_weights(self) -> None:
        """The weights as loaded: their bytes, dtype and, where some are block FP8 (a released FP8
        checkpoint on CUDA, or quantization="fp8"), how many modules hold FP8 codes."""
        from hyla.layers.fp8_linear import Fp8Linear
        from hyla.layers.fp8_moe import Fp8StackedExperts

        fp8 = sum(isinstance(m, (Fp8Linear, Fp8StackedExperts)) for m in self.model.modules())
        kind = f"block FP8 in {fp8} modules, the rest {self.model.dtype}" if fp8 else f"{self.model.dtype}"
        if not fp8 and self.config.quantization:
            kind += f", quantization={self.config.quantization} dequantised on this device"
        log.info("weights: %.2f GiB on %s (%s%s)", self.model.weight_bytes() / 2**30, self.model.device, kind,
                 ", random (load_format=dummy)" if self.config.load_format == "dummy" else "")

    def _log_capacity(self, num_slots: int, num_pages: int, per_seq: int) -> None:
        """What the pools allow, as the engine will run it: the scheduler runs up to
        min(max_num_seqs, slots // slots per request) requests; prefix-cache checkpoints live in
        slots no request holds and are evicted when a request needs one."""
        cfg = self.config
        slot_bytes = self.model.state_bytes_per_slot(cfg.state_dtype)
        running = max(1, min(cfg.max_num_seqs, num_slots // per_seq))
        full_length = num_pages // -(-self.max_model_len // cfg.page_size)
        checkpoints = (f", {num_slots - running * per_seq} more for prefix-cache checkpoints"
                       if cfg.enable_prefix_caching else "")
        log.info("pools: %d state slots (%.2f GiB, %d per request%s), %d KV pages of %d tokens (%d tokens, %.2f GiB): "
                 "up to %d requests at once (max_num_seqs=%d), %d of them at max_model_len=%d", num_slots,
                 num_slots * slot_bytes / 2**30, per_seq, checkpoints, num_pages, cfg.page_size, num_pages * cfg.page_size,
                 num_pages * self.kv_bytes_per_page / 2**30, running, cfg.max_num_seqs, full_length,
                 self.max_model_len)
        from hyla.ops.kv_fp8 import is_fp8_kv

        if is_fp8_kv(cfg.kv_cache_dtype):
            auto = self.model.kv_bytes_per_token("auto")
            log.info("pools: KV pages in fp8 e4m3 with per-token fp32 scales (kv_cache_dtype=%s): %d B of KV per "
                     "token instead of %d B in %s (%.2fx the tokens per byte)", cfg.kv_cache_dtype,
                     self.model.kv_bytes_per_token(), auto, str(self.model.dtype).replace("torch.", ""),
                     auto / max(1, self.model.kv_bytes_per_token()))
        if running < cfg.max_num_seqs:
            log.warning("max_num_seqs=%d: the memory holds state slots for %d running requests", cfg.max_num_seqs,
                        running)

    def _eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a request (unless ignore_eos): config.json's `eos_token_id` (one id
        or a list), generation_config.json's, then the tokenizer's EOS token, in that order."""
        ids = token_ids(getattr(self.model.config, "eos_token_id", None), "config.json")
        ids += self.generation_defaults.eos_token_ids
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (vLLM's
        `get_default_sampling_params`): what a request that sets nothing runs with."""
        return SamplingParams(**self.generation_defaults.sampling)

    # ---- requests ------------------------------------------------------------------------
    def encode(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt is a string (needs a tokenizer) or a list of token ids; returns (text, ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer "
                                 "(tokenizer.json or tiktoken.model next to the checkpoint)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError("a prompt must be a string or a list of integer token ids")

    def validate(self, ids: list[int], params: SamplingParams) -> int:
        """Check a request before any work; returns its effective max_tokens."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no "
                             "room for output")
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}")
        biased = [t for t in (params.logit_bias or {}) if t >= self.vocab_size]
        if biased:
            raise ValueError(f"logit_bias token id {biased[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        outside = [t for t in (params.allowed_token_ids or []) if t >= self.vocab_size]
        if outside:
            raise ValueError(f"allowed_token_ids token id {outside[0]} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer")
            params.resolve_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
            outside = [t for word in params.bad_words_token_ids for t in word if t >= self.vocab_size]
            if outside:
                raise ValueError(f"bad_words token id {outside[0]} is outside the vocabulary "
                                 f"(0..{self.vocab_size - 1})")
        if params.priority and self.scheduler.policy != "priority":
            raise ValueError(f"priority {params.priority} needs the priority scheduling policy "
                             "(scheduling_policy='priority'); this engine schedules first come, first served")
        return params.max_tokens if params.max_tokens is not None else room

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None) -> None:
        """Queue a request; raises ValueError (and queues nothing) if it is invalid. prompt: text
        or token ids; prompt_token_ids: the prompt's ids when the caller tokenised it already
        (then `prompt` is only echoed in the outputs)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            text, ids = self.encode(prompt)
        else:
            text, ids = (prompt if isinstance(prompt, str) else None), self.encode(list(prompt_token_ids))[1]
        max_tokens = self.validate(ids, params)
        seq = Sequence(request_id, text, ids, params, max_tokens, self.eos_token_ids, device=self.model.device)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its slots and pages; returns False if it is unknown."""
        if request_id not in self.requests:
            return False
        self.drain()  # a step in flight still writes its requests' pages and slots
        seq = self.requests.pop(request_id, None)
        if seq is None:  # it finished in the step just collected
            return False
        self.scheduler.finish(seq)
        if self.spec is not None:
            self.spec.release(seq)
        seq.finish("abort")
        self.metrics["num_requests_aborted"] += 1
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests still to run, or outputs of a step collected outside `step` still to hand out."""
        return self.scheduler.has_unfinished() or bool(self._drained)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        try:
            return self._step()
        finally:
            ended = time.perf_counter()
            self.metrics["engine_step_seconds"] += ended - began
            if self.step_log is not None:
                self.step_log.record(began, ended)

    def _step(self) -> list[RequestOutput]:
        outputs, self._drained = self._drained, []
        if self.overlap is not None and self.overlap.flight is not None:
            # a decode step launched during the previous one (hyla.engine.overlap): no scheduling
            if self.step_log is not None:
                self.step_log.plan("decode in flight", self.overlap.flight.seqs)
            self.metrics["num_steps"] += 1
            outputs += self._land_decode(launch=True)
            self._apply_cache_transfers()
            return outputs
        if self.chain is not None and self.chain.flight is not None:
            # a step launched during the previous one (hyla.engine.spec.mtp.overlap): no scheduling
            if self.step_log is not None:
                self.step_log.plan("mtp in flight", self.chain.flight.seqs)
            self.metrics["num_steps"] += 1
            outputs += self._collect_flight(launch=True)
            self._apply_cache_transfers()
            return outputs
        batch = self.scheduler.schedule()
        self.runner.apply_transfers(batch.transfers)  # also with no request to run: evictions planned copies
        if batch.is_empty:
            return outputs
        if self.step_log is not None:
            self.step_log.plan("scheduled", batch.seqs, batch.num_new_tokens)
        self.metrics["num_steps"] += 1
        plain, spec = batch.split()
        outputs += self._plain_step(plain) if plain.seqs else []
        outputs += self._spec_step(spec) if spec.seqs else []
        self._apply_cache_transfers()
        return outputs

    def _apply_cache_transfers(self) -> None:
        """Run the copies the prefix cache planned while the step's requests were filed (an int8
        checkpoint packed from the slot just given back) before anything can reuse those slots."""
        if self.prefix_cache is not None:
            self.runner.apply_transfers(self.prefix_cache.take_transfers())

    @staticmethod
    def _score_prompts(seqs, scored: list[list[int]], sampling: list[bool], logits: torch.Tensor) -> torch.Tensor:
        """Fill the prompt logprobs of the positions in `scored` from their logits rows (each
        sequence's rows: its scored positions, then its sampling row) -> the sampling rows."""
        keep, at = [], 0
        for seq, positions, s in zip(seqs, scored, sampling):
            if positions:
                rows = logits[at:at + len(positions)]
                targets = [seq.prompt_token_ids[p + 1] for p in positions]
                scores, ranks = prompt_logprobs(rows, targets, seq.params.prompt_logprobs)
                for p, lp, rank in zip(positions, scores, ranks):
                    seq.prompt_logprobs[p + 1] = lp
                    seq.prompt_token_ranks[p + 1] = rank
            at += len(positions)
            if s:
                keep.append(at)
                at += 1
        return logits[keep]

    def _collect_flight(self, launch: bool) -> list[RequestOutput]:
        """Read the MTP step in flight and emit its tokens, after launching the step behind it
        when that applies (launch)."""
        seqs = self.chain.flight.seqs
        try:
            results = self.chain.advance(launch)
        except TensorParallelError:
            raise
        except Exception as err:  # noqa: BLE001 - isolate the failing request, keep serving the rest
            return self.recover([s for s in seqs if s.status is Status.RUNNING], err)
        # a step in flight always ran in the verify graphs (its "replay" commit is theirs); a None
        # result: the request finished the step before (its row was padding)
        return self._emit_verified(seqs, results, in_graph=True)

    def drain(self) -> None:
        """Collect a step in flight now (its outputs come with the next `step`): before anything
        changes its requests from outside the step loop."""
        if self.chain is not None and self.chain.flight is not None:
            self._drained += self._collect_flight(launch=False)
        if self.overlap is not None and self.overlap.flight is not None:
            self._drained += self._land_decode(launch=False)
            self._apply_cache_transfers()

    def _land_decode(self, launch: bool) -> list[RequestOutput]:
        """Draw the tokens of the decode step in flight, launch the one after it when that
        applies (launch), then read and emit them. Its requests that finished meanwhile (on the
        token it was fed: padding rows) are left out."""
        flight = self.overlap.take()
        live = [i for i, seq in enumerate(flight.seqs) if not seq.is_finished]
        seqs = [flight.seqs[i] for i in live]
        if not seqs:
            return []
        try:
            logits, argmax = flight.logits, flight.argmax
            if len(seqs) < len(flight.seqs):
                index = to_device_long(live, logits.device)
                logits, argmax = logits[index], argmax[index]
            for seq in seqs:
                seq.num_computed_tokens += 1  # the step in flight fed each its last token
            draws = PendingSample(logits, seqs, self.generator, argmax if argmax_draws(seqs) else None)
            if launch:
                self.overlap.launch(seqs, draws)
            tokens, logprobs = draws.result()
        except TensorParallelError:
            raise
        except Exception as err:  # noqa: BLE001 - isolate the failing request, keep serving the rest
            self.overlap.abandon(self.model.device)
            return self.recover(seqs, err)
        return self._emit_drawn(seqs, tokens, logprobs)

    def _plain_step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Prefill chunks and (non-speculative) decodes: one forward, one sample per finished prompt
        (none for a max_tokens=0 request, which ends there)."""
        fed = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        sampling = [f and seq.max_tokens > 0 for seq, f in zip(batch.seqs, fed)]
        scored = [_scored_prompt_positions(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        rows = [[p - seq.num_computed_tokens for p in ps] + ([n - 1] if s else [])
                for seq, n, s, ps in zip(batch.seqs, batch.num_new_tokens, sampling, scored)]
        checkpoints = [[(pos - seq.num_computed_tokens, slot) for pos, slot in e]
                       for seq, e in zip(batch.seqs, batch.exports)] if any(batch.exports) else None
        to_drafter = self.spec is not None and self.spec.wants_prefill_hidden  # an MTP head reads the prompt too
        try:
            result = self.runner.execute(StepPlan.plain(batch.seqs, batch.num_new_tokens, rows, checkpoints),
                                         return_hidden=to_drafter)
        except TensorParallelError:
            raise  # the worker group is gone: no request can run
        except Exception as err:  # noqa: BLE001 - isolate the failing request, keep serving the rest
            self.scheduler.drop_exports(batch)
            return self.recover(batch.seqs, err)
        logits = result.logits
        if to_drafter:
            self.spec.observe_prefill(batch.seqs, batch.num_new_tokens, result.hidden)
        if any(scored):
            logits = self._score_prompts(batch.seqs, scored, sampling, logits)
        for seq, n, e in zip(batch.seqs, batch.num_new_tokens, batch.exports):
            seq.num_computed_tokens += n
            self.scheduler.file_exports(seq, e)
        to_sample = [seq for seq, s in zip(batch.seqs, sampling) if s]
        argmax = result.argmax if result.argmax is not None and not any(scored) and argmax_draws(to_sample) else None
        draws = PendingSample(logits, to_sample, self.generator, argmax) if to_sample else None
        if (self.overlap is not None and draws is not None and len(to_sample) == len(batch.seqs)
                and all(n == 1 for n in batch.num_new_tokens) and not any(scored)):
            try:  # the next decode step, queued before these draws are read (hyla.engine.overlap)
                self.overlap.launch(batch.seqs, draws)
            except TensorParallelError:
                raise
            except Exception as err:  # noqa: BLE001 - a half-run launch: recompute its requests
                self.overlap.abandon(self.model.device)
                return self.recover(batch.seqs, err)
        tokens, logprobs = draws.result() if draws is not None else ([], [])
        outputs = self._emit_drawn(to_sample, tokens, logprobs)
        if to_drafter:  # after sampling: a finished prompt's last row pairs with the token just sampled
            self.spec.commit_prefill(batch.seqs, batch.num_new_tokens)
        for seq, f, s in zip(batch.seqs, fed, sampling):
            if f and not s:  # after the drafter's commit: finishing releases the request's drafter state
                outputs.append(self._finish_prefill_only(seq))
        return outputs

    def _emit_drawn(self, seqs: list[Sequence], tokens: list, logprobs: list) -> list[RequestOutput]:
        """Emit one drawn token per sequence (a failed draw finishes its request with the error)."""
        outputs = []
        for seq, token, lp in zip(seqs, tokens, logprobs):
            seq.suspect = False  # it ran without error
            if token is None:  # sampling failed for this row only (lp holds the error)
                outputs += self.recover([seq], lp)
                continue
            self._emit(seq, token, lp)
            if seq.is_finished:
                self.on_finish(seq)
            outputs.append(seq.to_output())
        return outputs

    def _finish_prefill_only(self, seq: Sequence) -> RequestOutput:
        """A max_tokens=0 request whose prompt is computed (its prompt logprobs too): it finishes
        with no token sampled, finish_reason "length", and gives back its slots and pages (the
        prefix cache files its state as any finished request's)."""
        seq.suspect = False  # it ran without error
        self.metrics["prompt_tokens"] += len(seq.prompt_token_ids)
        seq.finish("length")
        self.on_finish(seq)
        return seq.to_output()

    def _spec_step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Speculative decodes: SpecDecoder drafts, verifies and accepts; here the tokens are
        emitted (stopping early where a request finishes), the state is committed to the kept
        tokens and the pages of rejected positions go back."""
        seqs = batch.seqs
        try:
            results = self.spec.step(seqs, batch.max_drafts, self.generator, self.chain)
        except TensorParallelError:
            raise
        except Exception as err:  # noqa: BLE001 - isolate the failing request, keep serving the rest
            return self.recover(seqs, err)
        return self._emit_verified(seqs, results, in_graph=results[0].in_graph)  # one verify: the same for all

    def _emit_verified(self, seqs: list[Sequence], results, in_graph: bool) -> list[RequestOutput]:
        """Emit a verify step's tokens, commit the states to the kept ones (in_graph: the verify
        ran in a CUDA graph), trim the rejected positions' pages (not while a later step is in
        flight: its block tables are fixed). results[i] None: seqs[i] finished before the step,
        which ran its row as padding (a step in flight); the graph's commit still takes every
        row in order."""
        trim = self.chain is None or self.chain.flight is None
        row_kept = [1 if r is None else 0 for r in results]  # a padding row's commit touches scratch only
        live = [i for i, r in enumerate(results) if r is not None]
        seqs, results = [seqs[i] for i in live], [results[i] for i in live]
        kept = []
        for seq, r in zip(seqs, results):
            seq.suspect = False
            kept.append(self.append_tokens(seq, r.tokens, r.logits))
            self.metrics["spec_num_draft_tokens"] += r.num_drafted
            self.metrics["spec_num_drafts"] += r.num_drafted > 0  # verify steps that drafted (vLLM's num_drafts)
            self.metrics["spec_num_accepted_tokens"] += r.num_accepted
            self.metrics["spec_num_verify_steps"] += 1
        for i, n in zip(live, kept):
            row_kept[i] = n
        self.spec.commit(seqs, kept, in_graph,
                         state_committed=self.chain is not None and self.chain.take_state_committed(),
                         row_kept=row_kept)
        outputs = []
        for seq, n in zip(seqs, kept):
            seq.num_computed_tokens += n
            if trim:
                self.scheduler.trim(seq)
            if seq.is_finished:
                self.on_finish(seq)
            outputs.append(seq.to_output())
        return outputs

    def recover(self, seqs: list[Sequence], err: Exception) -> list[RequestOutput]:
        """A step failed for `seqs`. One sequence: finish it with the error (its resources are
        freed). Several: their states may be half-written, so preempt them all (exact
        recomputation) and mark them suspect: the scheduler then runs suspects one at a time until
        the culprit fails alone. Other requests are never affected."""
        if len(seqs) > 1:
            log.warning("a step of %d requests failed (%s): retrying them one at a time", len(seqs), err)
            for seq in seqs:
                if seq.status is Status.RUNNING:
                    self.scheduler.preempt(seq)
                seq.suspect = True
            return []
        seq = seqs[0]
        log.error("request %s failed: %s: %s", seq.request_id, type(err).__name__, err)
        seq.error = f"{type(err).__name__}: {err}"
        self.scheduler.finish(seq)
        if self.spec is not None:
            self.spec.release(seq)
        seq.finish("error")
        self.requests.pop(seq.request_id, None)
        self.metrics["num_requests_failed"] += 1
        return [seq.to_output()]

    def _emit(self, seq: Sequence, token: int, logprobs) -> None:
        if not seq.output_token_ids and seq.num_preemptions == 0:
            self.metrics["prompt_tokens"] += len(seq.prompt_token_ids)
        seq.append_token(token, logprobs)
        self.metrics["generation_tokens"] += 1
        seq.check_stop(self.tokenizer)

    def append_tokens(self, seq: Sequence, tokens: list[int], raw_logits: torch.Tensor) -> int:
        """Emit several tokens of one verify step in order, stopping early if the request
        finishes; returns how many were kept. raw_logits[i]: the logits token i was chosen from."""
        kept, n = 0, seq.params.logprobs
        for i, token in enumerate(tokens):
            # (the logits rows are touched only for logprobs: a row view is a tensor op)
            self._emit(seq, token, None if n is None else token_logprobs(raw_logits[i], token, n))
            kept += 1
            if seq.is_finished:
                break
        return kept

    def on_finish(self, seq: Sequence) -> None:
        if self.spec is not None:
            self.spec.release(seq)
        self.scheduler.finish(seq, file_in_cache=True)
        self.requests.pop(seq.request_id, None)
        self.metrics["num_requests_finished"] += 1

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device) and close the step log;
        the engine is unusable after."""
        if self.workers is not None:
            self.workers.close()
        if self.step_log is not None:
            self.step_log.close()

    def get_metrics(self) -> dict:
        m = dict(self.metrics)
        m["num_preemptions"] = self.scheduler.num_preemptions
        m["model_execute_seconds"] = self.runner.execute_seconds()
        m["prefix_cache_query_tokens"] = self.scheduler.cache_query_tokens
        m["prefix_cache_hit_tokens"] = self.scheduler.cache_hit_tokens
        # reported with the cache (or its tiers) off too: 0
        m.update(cached_pages=0, cached_checkpoints=0, host_cached_pages=0, host_cached_checkpoints=0, hits_device=0,
                 hits_host=0, hit_tokens_host=0, bytes_to_host=0, bytes_from_host=0, restore_seconds=0.0)
        if self.prefix_cache is not None:
            usage = self.prefix_cache.usage()
            m.update(usage)
            on_device = usage["cached_checkpoints"] - usage["host_cached_checkpoints"]
            m["prefix_cache_bytes"] = usage["cached_pages"] * self.kv_bytes_per_page + on_device * self.checkpoint_bytes
            m.update(self.runner.tier_stats())
        running = self.scheduler.running
        m.update(state_slots_running=sum(len(s.spec_slots) or 1 for s in running),
                 kv_pages_running=len({p for s in running for p in s.block_table}))
        m.update(num_requests_running=len(running), num_requests_waiting=len(self.scheduler.waiting),
                 kv_pages_total=self.pools.pages.num_pages, kv_pages_free=self.pools.pages.num_free,
                 state_slots_total=self.pools.slots.num_slots, state_slots_free=self.pools.slots.num_free)
        drafted, steps = m["spec_num_draft_tokens"], m["spec_num_verify_steps"]
        m["spec_acceptance_rate"] = m["spec_num_accepted_tokens"] / drafted if drafted else 0.0
        # Tokens emitted per verify step (1 = nothing accepted).
        m["spec_mean_accepted_length"] = (m["spec_num_accepted_tokens"] + steps) / steps if steps else 0.0
        return m


def _scored_prompt_positions(seq: Sequence, num_new: int) -> list[int]:
    """The positions of this step's new tokens whose logits score the next prompt token (a
    request with prompt_logprobs): every prompt position but the last, whose logits pick the first
    output token. A preempted request recomputes them, to the same values."""
    if seq.prompt_logprobs is None:
        return []
    start = seq.num_computed_tokens
    return list(range(start, min(start + num_new, len(seq.prompt_token_ids) - 1)))


__all__ = ["LLMEngine"]
