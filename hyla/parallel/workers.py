"""WorkerGroup: rank 0 (this process, where the scheduler runs) and N-1 worker processes it
starts itself, one per device.

    group = WorkerGroup(2, torch.device("cpu"))         # spawns rank 1, joins the groups
    group.call("load", spec, reply=True)                # every rank loads its shard
    group.call("runner_call", [], "execute", plan)      # a step: broadcast, then run here too
    group.close()                                       # "exit" to the workers, reap them

Startup: a TCPStore on a free port (port 0), the workers started as `python -m
hyla.parallel.worker` (torchrun-style environment, no re-import of the caller's __main__), each
checking in on the store while rank 0 watches their exit codes: a worker that dies during
startup ends it at once with its exit code, one that never shows up after `startup_timeout_s`
too. Then every rank joins the default group (gloo on the CPU, NCCL on CUDA) and a gloo command
group (hyla.parallel.worker).

A dead worker: one watchdog thread per worker waits on its process; once one exits, every later
call raises TensorParallelError naming it, and a call blocked in a collective at that moment
fails too (gloo: the peer's socket closes; NCCL: the watchdog aborts the group). The group then
closes: survivors are told to exit, then terminated, and the process groups destroyed. Workers
also die with rank 0 (PR_SET_PDEATHSIG): no orphans.

Lifetime: what close() releases (the processes, the command group, the flags the watchdogs set)
lives in a _GroupState that the watchdog threads and a weakref.finalize hold instead of the
WorkerGroup itself, so a group nobody references any more (an `LLM` deleted and collected) is
closed by the garbage collector, and at interpreter exit if it is still alive then.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hyla.parallel.errors import TensorParallelError
from hyla.parallel.worker import Worker, init_groups

log = logging.getLogger("hyla.parallel")

_DIST_HINTS = ("gloo", "nccl", "NCCL", "c10d", "Connection", "peer", "timed out", "Timeout")


@dataclass
class _GroupState:
    """What close() releases and the watchdogs set; shared by the WorkerGroup, its watchdog threads
    and its finalizer (none of which may hold the WorkerGroup: see the module docstring)."""

    backend: str
    closed: bool = False
    dead: tuple[int, int] | None = None  # (rank, exit code) of the first worker seen to exit
    ctrl: object = None  # the gloo command group
    procs: list[subprocess.Popen] = field(default_factory=list)


class WorkerGroup:
    def __init__(self, world: int, device: torch.device, startup_timeout_s: float = 120.0,
                 step_timeout_s: float = 600.0):
        if dist.is_initialized():
            raise ValueError("torch.distributed is already initialised in this process: one tensor-parallel "
                             "engine per process (shut the other one down first)")
        self.world, self.device = world, torch.device(device)
        self.state = _GroupState("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend == "nccl":
            torch.cuda.set_device(self.device.index or 0)  # rank 0's NCCL communicators live on its device
        self.replies: list = []  # every rank's result of the last reply call
        self.worker = Worker(0, world)
        self.on_failure = None  # callable(TensorParallelError), e.g. the server stopping itself
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=startup_timeout_s))
        self._finalizer = weakref.finalize(self, _close, self.state)  # also runs at interpreter exit
        try:
            self._spawn(store, step_timeout_s)
            self._wait_for_workers(store, startup_timeout_s)
            self.state.ctrl = init_groups(self.backend, store, 0, world, step_timeout_s)
        except BaseException:
            self.close()
            raise
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=_watch, args=(self.state, rank, proc), name=f"hyla-tp-watch-{rank}",
                             daemon=True).start()

    # the group's flags and handles live in its _GroupState
    backend = property(lambda self: self.state.backend)
    closed = property(lambda self: self.state.closed)
    dead = property(lambda self: self.state.dead)
    ctrl = property(lambda self: self.state.ctrl)
    procs = property(lambda self: self.state.procs)

    def pool_budget(self) -> int:
        """90% of the free memory of the tightest rank (the pools have the same counts on every
        rank), as size_pools takes of one device."""
        self.call("free_memory", reply=True)
        return int(min(self.replies) * 0.9)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def model(self):
        return self.worker.model

    def _spawn(self, store, step_timeout_s: float) -> None:
        base = self.device.index or 0
        for rank in range(1, self.world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(base + rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), HYLA_TP_BACKEND=self.backend,
                       HYLA_TP_PARENT=str(os.getpid()), HYLA_TP_TIMEOUT=str(step_timeout_s))
            self.procs.append(subprocess.Popen([sys.executable, "-m", "hyla.parallel.worker"], env=env))

    def _wait_for_workers(self, store, timeout_s: float) -> None:
        keys = [f"hyla/up/{r}" for r in range(1, self.world)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    raise TensorParallelError(f"tensor-parallel worker {rank} exited with code {proc.returncode} "
                                              "during startup (its error is in the output above)")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within {timeout_s:.0f} s")
            time.sleep(0.05)

    def _death(self) -> str:
        rank, code = self.dead
        return (f"tensor-parallel worker {rank} (pid {self.procs[rank - 1].pid}) died with exit code {code}; "
                "the engine stopped")

    # -- commands -------------------------------------------------------------------------------
    def call(self, name: str, *args, reply: bool = False, local=None, **kwargs):
        """Run Worker.<name>(*args, **kwargs) on every rank: broadcast it, then run it here.
        reply: wait for every rank's outcome and raise the errors (startup commands); the
        results of all ranks are then in `self.replies`. local: what rank 0 runs instead (a
        callable of no arguments), for a call whose rank-0 side needs objects that do not travel
        (the engine's Sequences with their generators: the MTP drafter). Returns rank 0's result.
        Raises TensorParallelError when the group is broken."""
        if self.closed:
            raise TensorParallelError(self._death() if self.dead else "the tensor-parallel group is closed")
        if self.dead is not None:
            self._fail(None)
        try:
            dist.broadcast_object_list([(name, args, kwargs, reply)], src=0, group=self.ctrl)
            here = local if local is not None else (lambda: getattr(self.worker, name)(*args, **kwargs))
            if not reply:
                return here()
            error, result = None, None
            try:
                result = here()
            except Exception as err:  # noqa: BLE001 - gathered with the others' outcome below
                error = (type(err).__name__, f"rank 0: {type(err).__name__}: {err}")
            outcomes = [None] * self.world
            dist.all_gather_object(outcomes, (error, result), group=self.ctrl)
        except TensorParallelError:
            raise
        except Exception as err:  # noqa: BLE001 - sorted out by _fail
            if self._broken(err):
                self._fail(err)
            raise
        failed = [e for e, _ in outcomes if e is not None]
        self.replies = [r for _, r in outcomes]
        if failed:  # a ValueError everywhere (e.g. a checkpoint that does not match) stays one
            kind = ValueError if all(k == "ValueError" for k, _ in failed) else RuntimeError
            raise kind(f"{name} failed on {len(failed)} of {self.world} ranks: " + "; ".join(m for _, m in failed))
        return result

    def _broken(self, err: Exception) -> bool:
        """Whether `err` is the group breaking (a worker died: wait a moment for its exit to be
        seen) rather than an error of this step that every rank met alike."""
        if isinstance(err, getattr(dist, "DistError", ())) or any(h in str(err) for h in _DIST_HINTS):
            deadline = time.monotonic() + 2.0
            while self.dead is None and time.monotonic() < deadline:
                time.sleep(0.02)
            return True
        return self.dead is not None

    def _fail(self, err: Exception | None):
        message = self._death() if self.dead is not None else f"a tensor-parallel collective failed: {err}"
        self.close()
        error = TensorParallelError(message)
        if self.on_failure is not None:
            self.on_failure(error)
        raise error from err

    def close(self) -> None:
        """Stop the workers (exit command, then terminate / kill after a grace period) and leave
        the process groups. Idempotent; also run when the group is collected or at exit."""
        self._finalizer()


def _watch(state: _GroupState, rank: int, proc: subprocess.Popen) -> None:
    """Watchdog of worker `rank`: record its exit (the first one seen) and, on NCCL, abort the
    process group so that a collective in flight fails now instead of at its timeout."""
    code = proc.wait()
    if state.closed or state.dead is not None:
        return
    state.dead = (rank, code)
    log.error("tensor-parallel worker %d (pid %d) exited with code %s", rank, proc.pid, code)
    if state.backend == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            try:
                abort()
            except Exception:  # noqa: BLE001 - best effort; the step timeout remains
                log.exception("aborting the process group failed")


def _close(state: _GroupState) -> None:
    """WorkerGroup.close (run once, by close(), the garbage collector or at exit)."""
    if state.closed:
        return
    state.closed = True
    if state.ctrl is not None and state.dead is None:
        try:
            dist.broadcast_object_list([("exit", (), {}, False)], src=0, group=state.ctrl)
        except Exception as err:  # noqa: BLE001 - a worker is gone: terminated below
            log.debug("exit command not delivered: %s", err)
    grace = 5.0 if state.dead is None else 0.0  # survivors of a dead peer only wait in broken collectives
    for proc in state.procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    state.ctrl = None
    if dist.is_initialized():
        # NCCL's destroy may hang after a CUDA-graph capture (pytorch#115388): bounded wait
        leave = threading.Thread(target=_leave, name="hyla-tp-leave", daemon=True)
        leave.start()
        leave.join(timeout=10.0)


def _leave() -> None:
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        log.exception("leaving the process group failed")
