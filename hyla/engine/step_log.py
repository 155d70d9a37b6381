"""A per-step trace of the engine (EngineConfig.step_log, `hyla serve --step-log PATH`): one JSON
line per engine step, so that a served run's time to first token can be taken apart into the
steps each request waited behind (which steps were prefill, how many tokens and prompts they
carried, how long each took on the host's clock).

Each line:
    t_ms            when the step began, ms since the log was opened (the engine's start)
    wall_ms         the step's wall time (LLMEngine.step: scheduling, the forward, sampling, outputs)
    kind            "scheduled" (planned by the scheduler: a prefill chunk, decodes, speculative
                    decodes, in one forward), "decode in flight" (a decode step launched during the
                    previous one, hyla.engine.overlap) or "mtp in flight" (likewise for MTP's fused
                    steps, hyla.engine.spec.mtp.overlap)
    rows            requests in the step
    decode_rows     requests feeding their last generated token (with drafts, when speculating)
    prefill         [request id, tokens this step, tokens computed before it] per request still
                    computing its prompt (a chunk, a prefix-cache hit's remainder, a whole prompt)
                    or recomputing after a preemption
A step the scheduler found nothing for writes no line. Two other kinds of line:
    {"kind": "origin", "perf_counter_s": T}    the first line: time.perf_counter() when the log
                    was opened, t_ms's zero (on Linux a system-wide monotonic clock, so a client
                    on the same machine can place its own times among the steps: `hyla bench
                    serve` saves its clock_origin_s, scripts/step_log_summary.py joins them)
    {"kind": "arrival", "t_ms": T, "request": ID}    when a server submitted the request to the
                    engine (hyla.server.async_engine; its prompt prepared), written when the
                    engine's loop took it in
The file is line-buffered: a line is complete when its step is."""

from __future__ import annotations

import json
import time
from pathlib import Path


class StepLog:
    """Appends one JSON line per engine step to `path` (created or truncated at open)."""

    def __init__(self, path: str | Path):
        try:
            self._file = open(path, "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the engine's life
        except OSError as err:
            raise ValueError(f"step_log: cannot write {str(path)!r}: {err.strerror}") from None
        self._origin = time.perf_counter()
        self._pending: dict | None = None
        self._write({"kind": "origin", "perf_counter_s": self._origin})

    def _write(self, line: dict) -> None:
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def arrival(self, request_id: str, submitted: float) -> None:
        """A server's request reached the engine; submitted: its time.perf_counter() then."""
        self._write({"t_ms": round((submitted - self._origin) * 1e3, 3), "kind": "arrival", "request": request_id})

    def plan(self, kind: str, seqs, num_new_tokens=None) -> None:
        """What the step about to run carries (before it changes the requests): seqs and, for a
        scheduled step, each one's new tokens (None: one each)."""
        counts = num_new_tokens if num_new_tokens is not None else [1] * len(seqs)
        prefill = [[seq.request_id, n, seq.num_computed_tokens] for seq, n in zip(seqs, counts)
                   if seq.num_computed_tokens < max(len(seq.prompt_token_ids), seq.num_tokens - 1)]
        self._pending = {"kind": kind, "rows": len(seqs), "decode_rows": len(seqs) - len(prefill), "prefill": prefill}

    def record(self, began: float, ended: float) -> None:
        """Write the planned step's line (nothing when no step was planned since the last)."""
        if self._pending is None:
            return
        line = {"t_ms": round((began - self._origin) * 1e3, 3), "wall_ms": round((ended - began) * 1e3, 3)}
        line.update(self._pending)
        self._pending = None
        self._write(line)

    def close(self) -> None:
        self._file.close()
