import torch, time
from hyla import LLM, SamplingParams
from hyla.models import default_model_path
prompts = ["def read_file(path):", "import os", "class Point:", "for i in range(10):"] * 4
sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
cpu = [o.outputs[0].token_ids for o in LLM(str(default_model_path()), device="cpu").generate(prompts, sp, use_tqdm=False)]
for kw in [dict(), dict(async_scheduling=False), dict(enforce_eager=True), dict(enable_prefix_caching=True),
           dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
           dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "rollback": "replay"})]:
    llm = LLM(str(default_model_path()), device="cuda", dtype="float32", memory_budget=1 << 30, **kw)
    t = time.perf_counter()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    same = sum(a == b for a, b in zip(got, cpu))
    print(f"{str(kw)[:70]:<72} equal to CPU greedy: {same}/{len(prompts)}  {time.perf_counter()-t:.2f}s")
    del llm
    torch.cuda.empty_cache()
