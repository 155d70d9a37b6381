"""The Proposer protocol (hyla.engine.spec.protocol): every proposer has propose / observe /
commit / release (and the startup hooks), none runs the target; the decoder runs the verify,
plain or with the proposer's graph extension, and an extension that declines leaves the plain
verify to run."""

from __future__ import annotations

import torch

from hyla.engine.config import SpecConfig
from hyla.engine.sampling_params import SamplingParams
from hyla.engine.spec.acceptance import Verified
from hyla.engine.spec.decoder import SpecDecoder
from hyla.engine.spec.draft_model import DraftModelDrafter
from hyla.engine.spec.mtp.drafter import MTPDrafter
from hyla.engine.spec.ngram import NgramDrafter
from hyla.engine.spec.protocol import GraphExtension, Proposer
from hyla.engine.step_plan import StepResult
from hyla.parallel.drafter import TPDrafter

STEP = ("propose", "observe", "commit", "release")
STARTUP = ("kv_bytes_per_token", "bind_weight_bytes", "bind")


def test_every_proposer_has_the_protocol_and_none_runs_the_target():
    for cls in (NgramDrafter, DraftModelDrafter, MTPDrafter, TPDrafter):
        assert issubclass(cls, Proposer)
        assert all(callable(getattr(cls, name)) for name in STEP + STARTUP)
        assert not hasattr(cls, "verify")  # the decoder runs every verify
    assert Proposer.graph_extension is None and Proposer.needs_hidden is False


class _Seq:
    def __init__(self, i: int):
        self.request_id, self.guide, self.guide_pending = str(i), None, None
        self.params = SamplingParams(temperature=0.0)
        self.token_ids, self.output_token_ids, self.generator = [1, 2, 3], [3], None
        # what a verify's StepPlan reads: its last token, context, pages and slots
        self.last_token_id, self.num_computed_tokens, self.block_table = 3, 2, [i]
        self.slot, self.spec_slots = 3 * i, [3 * i, 3 * i + 1, 3 * i + 2]


class _Runner:
    """What SpecDecoder calls on the target's runner, recorded."""

    def __init__(self):
        self.calls = []
        self.model = type("M", (), {"config": type("C", (), {"vocab_size": 8})()})()

    def execute(self, plan, *, return_hidden=False, device_logits=False, extension=None):
        assert plan.is_verify
        if extension is not None:  # the verify with the proposer's graph extension
            self.calls.append(("verify_extended", extension))
            return StepResult("logits", "hidden", ("packed",), in_graph=True)
        self.calls.append(("verify", plan.pad_to))
        return StepResult(torch.zeros(sum(plan.seq_lens), 8))


class _Extension(GraphExtension):
    def __init__(self, takes: bool):
        self.takes, self.seen = takes, []

    def extend(self, seqs, drafts, pad_to):
        self.seen.append(("extend", pad_to))
        return "part" if self.takes else None

    def launched(self, seqs, drafts, outputs, pad_to):
        self.seen.append(("launched", outputs))
        return "flight"

    def collect(self, flight):
        self.seen.append(("collect", flight))
        return [Verified([1, 2], torch.zeros(2, 8), 1) for _ in range(2)]


class _Proposer(Proposer):
    def __init__(self, extension):
        self.graph_extension = extension

    def propose(self, seqs, ks, generator=None):
        return [([3] * k, None) for k in ks]


class _Chain:
    def __init__(self):
        self.launched, self.abandoned = [], 0

    def launch_after(self, flight):
        self.launched.append(flight)

    def abandon(self):
        self.abandoned += 1


def test_the_decoder_runs_the_verify_with_the_graph_extension():
    cfg = SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    seqs = [_Seq(0), _Seq(1)]
    ext, runner, chain = _Extension(takes=True), _Runner(), _Chain()
    out = SpecDecoder(cfg, _Proposer(ext), runner).step(seqs, [2, 1], torch.Generator(), chain)
    assert runner.calls == [("verify_extended", "part")] and chain.launched == ["flight"]
    assert ext.seen == [("extend", 3), ("launched", ("logits", "hidden", "packed")), ("collect", "flight")]
    assert [v.tokens for v in out] == [[1, 2], [1, 2]]
    # an extension that declines the step: the decoder runs the plain verify and the acceptance
    ext, runner = _Extension(takes=False), _Runner()
    out = SpecDecoder(cfg, _Proposer(ext), runner).step(seqs, [2, 1], torch.Generator(), _Chain())
    assert runner.calls == [("verify", 3)] and ext.seen == [("extend", 3)] and len(out) == 2
