"""hyla bench spec on the CPU with the bundled model: every configuration's row, tokens/s with and
without the prefill, speed-ups against the configuration without speculation."""

from hyla.bench import spec


def test_spec_bench_rows_report_decode_speed_and_medians(capsys):
    """Every configuration's row with tokens/s with and without the prefill; --repeats 2: the
    configurations run interleaved, each row a median over the rounds with the spread of its
    decode speed-up (the baseline's is 1.0 in every round)."""
    rows = spec.main(["--k", "2", "--max-tokens", "8", "--method", "ngram", "--rollback", "slots",
                      "--device", "cpu", "--repeats", "2"])
    assert len(rows) == 2 * 2 * 2  # prompt sets x (off, ngram k=2) x (alone, together)
    for r in rows:
        assert r["tok_s"] > 0 and r["decode_tok_s"] > r["tok_s"]  # the decode phase excludes the prefill
        lo, hi = r["decode_speedup_range"]
        assert lo <= r["decode_speedup"] <= hi
        if r["spec"] == "off":
            assert r["speedup"] == r["decode_speedup"] == 1.0 and r["mean_acc"] == 1.0 and lo == hi == 1.0
    assert any(r["mean_acc"] > 1.0 for r in rows if r["spec"] != "off")  # repetitive prompts: drafts accepted
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "over 2 rounds" in out


def test_spec_bench_rejects_zero_repeats(capsys):
    import pytest

    with pytest.raises(SystemExit):
        spec.main(["--repeats", "0", "--device", "cpu"])
    assert "--repeats must be >= 1" in capsys.readouterr().err
