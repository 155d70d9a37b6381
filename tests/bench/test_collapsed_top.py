"""scripts/collapsed_top.py: a py-spy raw profile's functions ranked within a frame."""

from tests.scripts import load_script


def test_ranks_self_and_inclusive_within_a_frame(tmp_path, capsys, monkeypatch):
    profile = tmp_path / "host.txt"
    profile.write_text(
        "main (a.py:1);execute (/x/model_runner.py:10);forward (/x/m.py:5);linear (/x/l.py:3) 30\n"
        "main (a.py:1);execute (/x/model_runner.py:12);forward (/x/m.py:7) 10\n"
        "main (a.py:1);other (b.py:2) 5\n"
        "garbage line\n")
    collapsed_top = load_script("collapsed_top")
    monkeypatch.setattr("sys.argv", ["collapsed_top.py", str(profile), "--within", "execute (", "--top", "5"])
    collapsed_top.main()
    out = capsys.readouterr().out
    assert "# 40 samples through 'execute ('" in out
    self_rows = out.split("| inclusive % |")[0]
    assert "| 75.0 | linear (l.py) |" in self_rows and "| 25.0 | forward (m.py) |" in self_rows
    assert "other" not in out  # outside the frame
    # a function sampled at two lines is one row (lines dropped), counted once per stack
    assert "| 100.0 | forward (m.py) |" in out.split("| inclusive % |")[1]
