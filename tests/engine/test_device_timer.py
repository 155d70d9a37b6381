"""hyla.engine.device_timer: the device time of blocks of work, read without waiting."""

import pytest
import torch

from hyla.engine.device_timer import DeviceTimer


def test_cpu_blocks_add_their_wall_time():
    timer = DeviceTimer(torch.device("cpu"))
    with timer.measure():
        torch.randn(256, 256) @ torch.randn(256, 256)
    first = timer.seconds
    assert first > 0
    with timer.measure():
        pass
    assert timer.seconds >= first


def test_cuda_blocks_count_once_complete_and_captures_are_skipped(monkeypatch):
    """Fake events stand in for CUDA's: a block counts once its end event completed, at a later
    read too, and never twice; a block run during a graph capture records no event."""
    recorded, done = [], {"end": False}

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.t = len(recorded)
            recorded.append(self)

        def query(self):
            return done["end"]

        def elapsed_time(self, end):
            return 100.0 * (end.t - self.t)  # ms

    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    timer = DeviceTimer(torch.device("cuda"))
    with timer.measure():
        pass
    assert len(recorded) == 2 and timer.seconds == 0
    done["end"] = True
    assert timer.seconds == pytest.approx(0.1) and timer.seconds == pytest.approx(0.1)
    capturing["now"] = True
    with timer.measure():
        pass
    assert len(recorded) == 2 and timer.seconds == pytest.approx(0.1)


def test_an_unread_timer_keeps_few_events(monkeypatch):
    """Blocks measured without anyone reading `seconds` (offline generation, no scrape): the
    completed events are folded into the total as they pile up, never kept one pair per step."""
    from hyla.engine import device_timer

    created = []

    class Event:
        def __init__(self, enable_timing=False):
            created.append(self)

        def record(self):
            pass

        def query(self):
            return True

        def elapsed_time(self, end):
            return 1.0  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    timer = DeviceTimer(torch.device("cuda"))
    for _ in range(1000):
        with timer.measure():
            pass
        assert len(timer._pending) < device_timer.FOLD_AT
    assert timer.seconds == pytest.approx(1.0)
    assert len(created) <= 2 * device_timer.FOLD_AT  # folded pairs are recorded again, not re-created
