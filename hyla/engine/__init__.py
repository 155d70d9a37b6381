"""hyla.engine: continuous batching over paged KV + state slots (vLLM-style API).

One step, LLMEngine.step():
  Scheduler.schedule()     ScheduledBatch: requests and new-token counts, pages, state slots,
                           checkpoint exports, the prefix cache's planned copies (apply_transfers)
  plain rows               ModelRunner.execute(StepPlan.plain) -> ForwardBatch -> model.forward_batch:
                           per layer KDA / GDN (hyla.ops chunk / recurrent Triton kernels over the
                           slot pool), MLA / gated attention (paged Triton), MoE (fused Triton);
                           a pure decode replays a CUDA graph captured at startup
  speculating rows         SpecDecoder: propose, execute(StepPlan.verify), accept, commit
  sampler.PendingSample    penalties, masks, temperature / top-k / top-p / min-p, the draw (a
                           greedy batch's decode graph drew it: its argmax); one device-to-host
                           copy, waited for after the next decode step is queued
                           (hyla.engine.overlap: that step is landed by the next `step`)
  LLMEngine._emit          Sequence.check_stop; a finished request's slots and pages go back,
                           the prefix cache keeps its final state
"""

from hyla.engine.config import EngineConfig
from hyla.engine.llm import LLM
from hyla.engine.llm_engine import LLMEngine
from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
