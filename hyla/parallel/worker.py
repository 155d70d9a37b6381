"""One tensor-parallel rank: its shard of the model, a ModelRunner over its own pools, and (ranks
1..N-1) the loop that executes rank 0's broadcast commands.

Started by hyla.parallel.workers.WorkerGroup as `python -m hyla.parallel.worker` with a
torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) plus
HYLA_TP_BACKEND (gloo / nccl), HYLA_TP_PARENT (rank 0's pid: the worker dies with it) and
HYLA_TP_TIMEOUT (seconds a model collective may wait).

Two process groups: the default one (NCCL on CUDA, gloo on the CPU) carries the model's
collectives with a step-sized timeout; a gloo group `ctrl` carries rank 0's commands (pickled
objects) and never times out, since a worker may wait for the next step for as long as the
server idles.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from hyla.engine.step_plan import StepResult

log = logging.getLogger("hyla.parallel")

IDLE_TIMEOUT = datetime.timedelta(days=365)  # the command group: workers idle as long as the server


def init_groups(backend: str, store, rank: int, world: int, timeout_s: float):
    """Join the default group (model collectives) and create the command group; -> ctrl group."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:(base index + r), or the CPU."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class Worker:
    """What every rank (0 included) executes for a command: the same calls with the same
    arguments in the same order, so that the model's collectives line up."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.model = None
        self.plan = None  # the rank's ShardPlan (the MTP head is loaded with it too)
        self.runner = None
        self.drafter = None  # the rank's MTPDrafter (mtp_bind)
        self.hidden = None  # ranks 1..N-1: the last forward's hidden states, until the drafter observes them

    def load(self, spec: dict) -> None:
        """spec: model (checkpoint path), model_type, dtype, device (rank 0's), expert_parallel,
        random_weights (load_format "dummy"), quantization, fp8_weights, mxfp4_experts (the loader's),
        backend (rank 0's ops backend: hyla.ops.dispatch)."""
        from hyla.models.loader import load_model
        from hyla.ops import dispatch
        from hyla.parallel.plans import make_plan

        if spec.get("backend") is not None:
            dispatch.set_backend(spec["backend"])
        plan = self.plan = make_plan(spec["model_type"], self.rank, self.world, dist.group.WORLD,
                                     spec["expert_parallel"])
        device = rank_device(torch.device(spec["device"]), self.rank)
        self.model = load_model(spec["model"], dtype=spec["dtype"], device=device, shard=plan,
                                random_weights=spec.get("random_weights", False),
                                quantization=spec.get("quantization"),
                                fp8_weights=spec.get("fp8_weights", "auto"),
                                mxfp4_experts=spec.get("mxfp4_experts", "auto"))
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm)  # the model group's communicators exist before any CUDA-graph capture

    def free_memory(self) -> int:
        """Free bytes on this rank's device (0 on the CPU): the pools are sized by the tightest rank."""
        device = self.model.device
        if device.type != "cuda":
            return 0
        torch.cuda.empty_cache()  # loading's cached blocks back to the driver (hyla.engine.memory_profile)
        return torch.cuda.mem_get_info(device)[0]

    def make_runner(self, num_slots: int, num_pages: int, page_size: int, state_dtype, enforce_eager: bool,
                    kv_cache_dtype: str = "auto") -> None:
        from hyla.engine.model_runner import ModelRunner

        self.model.kv_cache_dtype = kv_cache_dtype  # the rank's pages (and byte counts) as rank 0's
        self.runner = ModelRunner(self.model, num_slots, num_pages, page_size, state_dtype, enforce_eager,
                                  kv_cache_dtype=kv_cache_dtype)

    def runner_call(self, ops: list, method: str, *args, **kwargs):
        """The deferred drafter calls `ops`, then ModelRunner.<method>(*args, **kwargs) on this
        rank's runner (hyla.parallel.runner.TPRunner sends them: one broadcast for both). A
        forward's hidden states (execute with return_hidden: the final-norm states, the same on
        every rank) stay on ranks 1..N-1 for their drafter's `observe`, which rank 0's engine
        sends next (rank 0 hands them over itself)."""
        self._drafter_ops(ops)
        out = getattr(self.runner, method)(*args, **kwargs)
        if self.rank and isinstance(out, StepResult) and out.hidden is not None:
            self.hidden = out.hidden
        return out

    # The MTP drafter's calls (hyla.parallel.drafter.TPDrafter sends them).
    def mtp_bind(self, cfg, page_size: int) -> tuple[int, int]:
        """This rank's MTPDrafter: its shard of the head (the rank's plan) and its KV per page
        -> (the head's weight bytes, its KV bytes per token) on this rank."""
        from hyla.engine.spec.mtp.drafter import MTPDrafter

        self.drafter = MTPDrafter(cfg, page_size=page_size)
        self.drafter.bind(self.runner, shard=self.plan)
        weights = sum(t.numel() * t.element_size() for t in self.drafter.head.state_dict().values())
        return weights, MTPDrafter.kv_bytes_per_token(self.model)

    def mtp_shapes(self) -> dict[str, tuple[int, ...]]:
        """The head's tensor shapes on this rank (its parameters, and "kv" of its key pool)."""
        shapes = {name: tuple(t.shape) for name, t in self.drafter.head.state_dict().items()}
        return {**shapes, "kv": tuple(self.drafter.kv.k.shape)}

    def drafter_call(self, ops: list, method: str, args: tuple):
        """Ranks 1..N-1 (rank 0 runs its own drafter directly): the deferred drafter calls, then
        one that runs the head (its collectives line up with rank 0's)."""
        self._drafter_ops(ops)
        return getattr(self.drafter, method)(*args)

    def _drafter_ops(self, ops: list) -> None:
        """Replay rank 0's drafter bookkeeping (observe / commit / release: no collectives) in its
        order; rank 0 did it when the engine called it."""
        if self.rank == 0:
            return
        for method, args in ops:
            if method == "observe":  # the rows of the forward just run here
                hidden, self.hidden = self.hidden, None
                self.drafter.observe(*args, hidden)
            else:
                getattr(self.drafter, method)(*args)


def serve(worker: Worker, ctrl) -> int:
    """Ranks 1..N-1: execute rank 0's commands until "exit" (-> 0) or until the group breaks
    (rank 0 gone -> 1). A command that fails here is logged; when it replies, the error goes to
    rank 0, which raises it."""
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=ctrl)
        except Exception as err:  # noqa: BLE001 - rank 0 is gone: nothing left to serve
            log.error("rank %d: lost rank 0 (%s); exiting", worker.rank, err)
            return 1
        name, args, kwargs, reply = box[0]
        if name == "exit":
            return 0
        error, result = None, None
        try:
            result = getattr(worker, name)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - reported (reply) or logged; rank 0 decides
            error = (type(err).__name__, f"rank {worker.rank}: {type(err).__name__}: {err}")
            log.exception("rank %d: command %s failed", worker.rank, name)
        if reply:
            try:
                dist.all_gather_object([None] * worker.world, (error, result), group=ctrl)
            except Exception:  # noqa: BLE001
                return 1


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when rank 0 dies (Linux prctl), and exit if it is already gone."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        def watch():  # elsewhere: poll
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:
        os._exit(1)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _die_with_parent(int(os.environ["HYLA_TP_PARENT"]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    backend = os.environ.get("HYLA_TP_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = float(os.environ.get("HYLA_TP_TIMEOUT", "600"))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    store.set(f"hyla/up/{rank}", "1")
    ctrl = init_groups(backend, store, rank, world, timeout)
    torch.set_grad_enabled(False)
    code = serve(Worker(rank, world), ctrl)
    if code == 0 and backend != "nccl":  # NCCL's may hang after a CUDA-graph capture (pytorch#115388): just exit
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
