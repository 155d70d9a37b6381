"""`hyla bench throughput` on the CPU: a tiny random checkpoint, a few tokens, both engines."""

import math

from hyla.bench.throughput import main


def test_offline_table_has_both_engines_and_the_ratio(capsys):
    res = main(["--random-config", "tiny", "--device", "cpu", "--num-prompts", "2", "--prompt-len", "8",
                "--new-tokens", "3", "--repeat", "1"])
    rows = res["offline"]
    assert [r["engine"] for r in rows] == ["hyla", "transformers", "hyla/transformers"]
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("prefill_tok_s", "decode_tok_s", "total_s"))
    out = capsys.readouterr().out
    table = [line.split()[0] for line in out.splitlines() if line and not line.startswith("#")]
    assert table == ["engine", "hyla", "transformers", "hyla/transf."]
    assert "greedy outputs identical for 2/2 prompts" in out  # same checkpoint, same greedy tokens
