"""The bookkeeping of hyla.engine.host_offload on the CPU, with fake CUDA streams and events that
log what they are asked (the copies themselves run at once): a queued copy carries the source as
it was when queued; a batch starts after the compute stream's work and records an event; copies
beyond the buffer budget go direct after a fence; completed batches give their room back. The
real streams are tested on CUDA (tests/gpu/test_host_offload_cuda.py)."""

import contextlib

import torch

from hyla.engine.host_offload import DeviceToHost


class FakeEvent:
    def __init__(self):
        self.done = False

    def record(self, stream):
        stream.log.append(("record", stream.name))
        self.stream = stream

    def query(self):
        return self.done


class FakeStream:
    def __init__(self, log, name="side", device=None):
        self.log, self.name, self.device = log, name, device

    def wait_stream(self, other):
        self.log.append((f"{self.name} waits for", other.name))

    def wait_event(self, event):
        self.log.append((f"{self.name} waits for", "event"))


def fake_cuda(monkeypatch) -> list:
    log = []
    compute = FakeStream(log, "compute")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log, "side", device))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(("keep buffer", s.name)))
    return log


def test_queued_copies_start_as_a_batch_after_the_compute_stream(monkeypatch):
    log = fake_cuda(monkeypatch)
    to_host = DeviceToHost(torch.device("cuda"), budget_bytes=64)  # 4 rows of 4 fp32
    src, host = torch.arange(16.0).reshape(4, 4), torch.zeros(4, 4)
    to_host.copy(host[0], src[0])
    to_host.copy(host[1], src[1] * 10, owned=True)
    src[0] = -1  # reused at once: the buffer kept the row as it was
    assert torch.equal(host, torch.zeros(4, 4)) and log == []  # nothing started before flush
    to_host.flush()
    assert torch.equal(host[0], torch.arange(4.0)) and torch.equal(host[1], torch.arange(4.0, 8.0) * 10)
    assert log == [("side waits for", "compute"), ("keep buffer", "side"), ("keep buffer", "side"),
                   ("record", "side")]
    to_host.flush()  # nothing queued: nothing happens
    assert len(log) == 4 and to_host.direct_bytes == 0


def test_copies_beyond_the_budget_go_direct_after_a_fence_until_room_comes_back(monkeypatch):
    log = fake_cuda(monkeypatch)
    to_host = DeviceToHost(torch.device("cuda"), budget_bytes=32)  # 2 rows of 4 fp32
    src, host = torch.arange(16.0).reshape(4, 4), torch.zeros(4, 4)
    to_host.copy(host[0], src[0])
    to_host.copy(host[1], src[1])
    assert host.abs().sum() == 0
    to_host.copy(host[2], src[2])  # over the budget: the queued two start, the compute stream waits
    assert log[-2:] == [("record", "side"), ("compute waits for", "event")]
    assert torch.equal(host[:3], src[:3]) and to_host.direct_bytes == 16
    to_host.copy(host[3], src[3])  # the batch still in flight holds the room: direct again
    assert to_host.direct_bytes == 32
    to_host._in_flight[0][0].done = True  # the batch completed: its room comes back
    to_host.copy(host[3], src[3] + 1)
    assert to_host.direct_bytes == 32 and torch.equal(host[3], src[3])  # queued, not yet started
    to_host.fence()  # a restore about to read the host: start it and wait for it
    assert torch.equal(host[3], src[3] + 1) and log[-1] == ("compute waits for", "event")


def test_on_the_cpu_every_copy_is_direct():
    to_host = DeviceToHost(torch.device("cpu"))
    src, host = torch.arange(4.0), torch.zeros(4)
    to_host.copy(host, src)
    assert torch.equal(host, src) and to_host.stream is None
    to_host.flush()
    to_host.fence()
