"""The per-step trace (EngineConfig.step_log, hyla.engine.step_log): one line per step that ran,
prefill chunks by request id adding up to each prompt's uncached tokens, decode rows adding up to
the generated tokens after the first, a prefix-cache hit's context, the CLI flag and a bad path."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.engine import EngineConfig, LLMEngine
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint


def _lines(path) -> list[dict]:
    """The log's step lines (after its origin line)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "origin" and lines[0]["perf_counter_s"] > 0
    return [line for line in lines[1:] if line["kind"] != "arrival"]


def _chunked_run(tmp_path):
    """Three prompts (37, 5, 61 tokens) in chunks of at most 24 tokens, 6 tokens each, traced ->
    (the engine, their outputs, the prompts, the log's path)."""
    model = build_kimi_checkpoint(tmp_path, "moe")
    log = tmp_path / "steps.jsonl"
    llm = LLM(str(model), device="cpu", dtype=torch.float32, max_num_batched_tokens=24, step_log=str(log))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (37, 5, 61)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    return llm, outs, prompts, log


def test_chunks_and_decodes_add_up(tmp_path):
    llm, outs, prompts, log = _chunked_run(tmp_path)
    lines = _lines(log)
    assert len(lines) == llm.engine.get_metrics()["num_steps"]
    assert all(l["rows"] == l["decode_rows"] + len(l["prefill"]) and l["wall_ms"] >= 0 for l in lines)
    assert all(a["t_ms"] + a["wall_ms"] <= b["t_ms"] + 1e-3 for a, b in zip(lines, lines[1:]))  # in order
    assert all(sum(n for _, n, _ in l["prefill"]) <= 24 for l in lines)  # the token budget
    by_request: dict[str, list] = {}
    for line in lines:
        for rid, n, before in line["prefill"]:
            by_request.setdefault(rid, []).append((n, before))
    ids = [o.request_id for o in outs]
    for rid, prompt in zip(ids, prompts):
        chunks = by_request[rid]
        assert [b for _, b in chunks] == [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
        assert sum(n for n, _ in chunks) == len(prompt)
    assert len(by_request[ids[2]]) >= 3  # 61 tokens in chunks of at most 24
    assert sum(l["decode_rows"] for l in lines) == 3 * (6 - 1)  # the first token comes with the prompt


def test_the_summary_counts_every_step(tmp_path, monkeypatch, capsys):
    from tests.scripts import load_script

    llm, _, _, log = _chunked_run(tmp_path)
    n = llm.engine.get_metrics()["num_steps"]
    monkeypatch.setattr("sys.argv", ["step_log_summary.py", str(log)])
    load_script("step_log_summary").main()
    out = capsys.readouterr().out
    assert out.startswith(f"{n} steps over ")
    rows = [r.split("|") for r in out.splitlines() if r.startswith("| prefill") or r.startswith("| scheduled")]
    assert sum(int(r[4]) for r in rows) == n


def test_the_summary_fits_a_fixed_part_and_a_cost_per_prompt_token(tmp_path, monkeypatch, capsys):
    """Steps whose wall time is exactly 40 ms + 20 us per prompt token (prompts split over several
    requests, decode steps between them) give back that line; one token count alone gives none."""
    from tests.scripts import load_script

    summary = load_script("step_log_summary")
    steps, t = [], 0.0
    for i, tokens in enumerate((700, 1100, 1900, 2600, 4096)):
        parts = [tokens // 3, tokens // 3, tokens - 2 * (tokens // 3)]
        wall = 40.0 + 0.02 * tokens
        steps.append({"t_ms": t, "wall_ms": wall, "kind": "scheduled", "rows": 3 + i, "decode_rows": i,
                      "prefill": [[f"r{i}-{j}", n, 0] for j, n in enumerate(parts)]})
        steps.append({"t_ms": t + wall, "wall_ms": 12.0, "kind": "decode in flight", "rows": 3 + i,
                      "decode_rows": 3 + i, "prefill": []})
        t += wall + 12.0
    fixed, per_token, n = summary.prefill_cost(steps)
    assert (round(fixed, 6), round(per_token, 9), n) == (40.0, 0.02, 5)
    assert summary.prefill_cost([steps[0], steps[1], dict(steps[0], t_ms=500.0)]) is None
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in steps))
    monkeypatch.setattr("sys.argv", ["step_log_summary.py", str(log)])
    summary.main()
    assert "prefill steps: 40.0 ms + 20.0 us per prefill token (least squares over 5 steps" in capsys.readouterr().out


def test_a_prefix_hit_shows_its_context(tmp_path):
    model = build_kimi_checkpoint(tmp_path, "moe")
    log = tmp_path / "steps.jsonl"
    llm = LLM(str(model), device="cpu", dtype=torch.float32, enable_prefix_caching=True, step_log=str(log))
    prompt = torch.randint(3, 200, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    second = llm.generate([prompt + [7, 8, 9]], params, use_tqdm=False)[0]
    chunks = [c for l in _lines(log) for c in l["prefill"] if c[0] == second.request_id]
    assert second.num_cached_tokens > 0
    assert chunks[0][2] == second.num_cached_tokens and sum(n for _, n, _ in chunks) == 73 - second.num_cached_tokens


def test_the_cli_flag_and_a_bad_path(tmp_path):
    from hyla.cli import _add_engine_args, _engine_config

    p = argparse.ArgumentParser()
    _add_engine_args(p, prefix_cache_default=False)
    base = ["--model", str(build_kimi_checkpoint(tmp_path, "moe")), "--device", "cpu"]
    assert _engine_config(p.parse_args(base)).step_log is None
    assert _engine_config(p.parse_args(base + ["--step-log", "/x/s.jsonl"])).step_log == "/x/s.jsonl"
    with pytest.raises(ValueError, match="step_log"):
        EngineConfig(model=base[1], step_log=3)
    with pytest.raises(ValueError, match="cannot write"):
        LLMEngine(EngineConfig(model=base[1], device="cpu", step_log=str(tmp_path / "missing" / "s.jsonl")))
