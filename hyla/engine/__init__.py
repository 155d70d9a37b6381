"""hyla.engine: continuous batching over paged KV + state slots (vLLM-style API).

One step, LLMEngine.step():
  Scheduler.schedule()      the ScheduledBatch: sequences and their new-token counts, KV pages,
                            state slots, checkpoint exports, the prefix cache's planned copies
  ModelRunner.apply_transfers  restores into the request's own slot / pages, tier moves
  plain rows: ModelRunner.execute(StepPlan.plain) -> ForwardBatch.build -> model.forward_batch,
                            per layer: KDA / GDN (hyla.ops chunk or recurrent Triton kernels over
                            the slot pool, short conv), MLA / gated attention (paged Triton), MoE
                            (fused-MoE Triton) -> StepResult: logits of the rows to sample (a
                            pure-decode batch replays one CUDA graph of all of it)
  speculating rows: SpecDecoder -> propose, ModelRunner.execute(StepPlan.verify: [x0, d1..dk]),
                            accept, commit ("slots": pick a slot; "replay": commit_replay)
  sampler.sample            penalties, grammar masks, temperature / top-k / top-p / min-p, the
                            draw: one device-to-host copy
  LLMEngine._emit           Sequence.check_stop (detokenise, stop rules); a finished request's
                            slots and pages go back, the prefix cache keeps its final state
"""

from hyla.engine.config import EngineConfig
from hyla.engine.llm import LLM
from hyla.engine.llm_engine import LLMEngine
from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
