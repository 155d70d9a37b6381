"""TPRunner: what LLMEngine holds as its runner under tensor parallelism -- ModelRunner's calls
(execute / commit_replay / apply_transfers / attach_tiers / copy_slot / copy_page_rows) sent to
every rank by name, each run on rank 0's own shard too. Every rank runs the same ModelRunner code
over its own pools (same page and slot counts, per-rank shapes), so the scheduler, the prefix
cache's checkpoint copies and speculative rollback stay exactly as on one device.

A step travels as its StepPlan (hyla.engine.step_plan: plain data, only the new tokens, never a
Sequence), the same object rank 0 runs. Logits come back all-gathered on every rank (the
vocab-parallel lm_head); rank 0 samples. An MTP drafter runs on every rank (shard_drafter,
hyla.parallel.drafter): its head steps are commands too, its bookkeeping rides along with the
next command.

    tp = start_tensor_parallel(config, dtype)      # workers up, every rank's shard loaded
    runner = tp_runner(tp, num_slots, num_pages, page_size, state_dtype, enforce_eager)
"""

from __future__ import annotations

import logging

from hyla.parallel.workers import WorkerGroup

log = logging.getLogger("hyla.parallel")


class TPRunner:
    def __init__(self, group: WorkerGroup):
        self.group = group
        self.local = group.worker.runner  # rank 0's ModelRunner
        self.model = self.local.model
        self.device, self.page_size = self.local.device, self.local.page_size
        # Drafter calls ranks 1..N-1 still owe (bookkeeping without collectives): they travel
        # with the next command, in order (hyla.parallel.drafter.TPDrafter).
        self.deferred: list[tuple[str, tuple]] = []

    def _call(self, method: str, *args, **kwargs):
        """ModelRunner.<method>(*args, **kwargs) on every rank (Worker.runner_call), the deferred
        drafter calls run before it on ranks 1..N-1 -> rank 0's result."""
        ops, self.deferred = self.deferred, []
        return self.group.call("runner_call", ops, method, *args, **kwargs)

    def defer(self, method: str, args: tuple) -> None:
        self.deferred.append((method, args))

    def drafter_call(self, method: str, args: tuple, local):
        """A drafter call that runs the head (collectives): ranks 1..N-1 run the deferred calls
        and then `method` on their drafter, rank 0 runs `local()` -> rank 0's result."""
        ops, self.deferred = self.deferred, []
        return self.group.call("drafter_call", ops, method, args, local=local)

    def shard_drafter(self, drafter):
        """The drafter SpecDecoder drives under tensor parallelism: an MTP head runs on every rank
        (hyla.parallel.drafter.TPDrafter); n-gram and draft-model drafters run on rank 0 alone."""
        from hyla.engine.spec.mtp.drafter import MTPDrafter

        if isinstance(drafter, MTPDrafter):
            from hyla.parallel.drafter import TPDrafter

            return TPDrafter(drafter.cfg, drafter.page_size)
        return drafter

    @property
    def cache(self):
        return self.local.cache

    @property
    def graphs(self):
        return self.local.graphs

    def execute(self, plan, *, return_hidden: bool = False, device_logits: bool = False):
        """ModelRunner.execute on every rank -> rank 0's StepResult; with return_hidden every
        rank keeps its own hidden states for its MTP drafter. No graph extension: the fused MTP
        step declines tensor parallelism (hyla.engine.spec.mtp.fused)."""
        return self._call("execute", plan, return_hidden=return_hidden, device_logits=device_logits)

    def commit_replay(self, accepted: list[int], in_graph: bool) -> None:
        self._call("commit_replay", list(accepted), in_graph)

    def copy_slot(self, src: int, dst: int) -> None:
        self._call("copy_slot", src, dst)

    def copy_page_rows(self, src: int, dst: int, rows: int) -> None:
        self._call("copy_page_rows", src, dst, rows)

    def apply_transfers(self, transfers: list[tuple]) -> None:
        if transfers:  # most steps have none: no broadcast
            self._call("apply_transfers", list(transfers))

    def attach_tiers(self, sizes) -> None:
        """Every rank allocates the prefix cache's tiers for its own shard (the same entry counts)."""
        self._call("attach_tiers", sizes)

    def execute_seconds(self) -> float:
        """Rank 0's execute device time (the ranks run the same steps in lockstep)."""
        return self.local.execute_seconds()

    def tier_stats(self) -> dict:
        """Rank 0's transfer counters (every rank moves the same entries of its own shard)."""
        return self.local.tier_stats()

    def close(self) -> None:
        self.group.close()


def start_tensor_parallel(config, dtype) -> WorkerGroup:
    """Start config.tensor_parallel_size ranks and load every rank's shard of config.model.
    Raises TensorParallelError (a worker died or never started) or the load error of any rank."""
    from hyla.models.loader import load_config
    from hyla.ops import dispatch

    group = WorkerGroup(config.tensor_parallel_size, config.device)
    spec = dict(model=config.model, model_type=load_config(config.model).model_type, dtype=dtype,
                device=str(config.device), expert_parallel=config.enable_expert_parallel,
                random_weights=config.load_format == "dummy", quantization=config.quantization,
                fp8_weights=config.fp8_weights, mxfp4_experts=config.mxfp4_experts,
                backend=dispatch.get_backend())  # every rank runs the ops' backend rank 0 runs
    try:
        group.call("load", spec, reply=True)
    except BaseException:
        group.close()
        raise
    group.model.kv_cache_dtype = config.kv_cache_dtype  # the report counts the pages as they will be stored
    log.info("tensor parallel over %d ranks (%s), per rank:\n%s", group.world, group.backend,
             group.model.memory_report(config.state_dtype))
    return group


def tp_runner(group: WorkerGroup, num_slots: int, num_pages: int, page_size: int, state_dtype,
              enforce_eager: bool, kv_cache_dtype: str = "auto") -> TPRunner:
    """Every rank allocates its pools (the same counts, its own shapes; FP8 pages with
    kv_cache_dtype "fp8") -> rank 0's TPRunner."""
    try:
        group.call("make_runner", num_slots, num_pages, page_size, state_dtype, enforce_eager, kv_cache_dtype,
                   reply=True)
    except BaseException:
        group.close()
        raise
    return TPRunner(group)
