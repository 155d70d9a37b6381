"""LLM: the offline API, as vLLM users know it.

    llm = LLM(model=path)          # or a bundled model's name ("default", "qwen3.5-mtp"), or a
                                   # Hugging Face Hub id ("org/name", revision=...): hyla.models.hub
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3], "cache_salt": "tenant-a"}])  # vLLM's prompt dicts
"""

from __future__ import annotations

import dataclasses

from tqdm import tqdm

from hyla.engine.config import EngineConfig
from hyla.engine.llm_engine import LLMEngine
from hyla.engine.outputs import RequestOutput
from hyla.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, dtype=None, device=None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 4096, max_model_len: int | None = None,
                 memory_budget: int | None = None, enable_prefix_caching: bool = False,
                 speculative_config: dict | None = None, enforce_eager: bool = False, seed: int = 0,
                 tensor_parallel_size: int = 1, enable_expert_parallel: bool = False, **kwargs):
        config = EngineConfig(model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                              memory_budget=memory_budget, enable_prefix_caching=enable_prefix_caching,
                              speculative_config=speculative_config, enforce_eager=enforce_eager, seed=seed,
                              tensor_parallel_size=tensor_parallel_size,
                              enable_expert_parallel=enable_expert_parallel, **kwargs)
        self.engine = LLMEngine(config)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, one token-id list or a list of them, or vLLM's
        prompt dicts (`prompt_dict`), one or a list. sampling_params: one for all, or one per
        prompt; None = get_default_sampling_params(). Returns outputs in prompt order. Every
        prompt is validated before any work is done (ValueError names the bad one)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:  # the checkpoint's generation_config.json defaults, as vLLM
            sampling_params = self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        encoded = []  # tokenised once: add_request takes the ids
        params = list(params)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                if isinstance(prompt, dict):
                    prompt, salt = prompt_dict(prompt)
                    if salt is not None:
                        params[i] = p = dataclasses.replace(p, cache_salt=salt)
                text, token_ids = self.engine.encode(prompt)
                self.engine.validate(token_ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            encoded.append((text, token_ids))
        ids = []
        for (text, token_ids), p in zip(encoded, params):
            rid = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(rid, text if text is not None else token_ids, p, prompt_token_ids=token_ids)
            ids.append(rid)
        finished: dict[str, RequestOutput] = {}
        show = len(prompts) >= 8 if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(prompts), desc="generate", disable=not show)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[rid] for rid in ids]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's generation_config.json sampling defaults
        (none with generation_config="vllm")."""
        return self.engine.default_sampling_params()

    def get_metrics(self) -> dict:
        return self.engine.get_metrics()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (also done at interpreter exit)."""
        self.engine.shutdown()


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def prompt_dict(prompt: dict) -> tuple[str | list[int], str | None]:
    """vLLM's TextPrompt {"prompt": text} or TokensPrompt {"prompt_token_ids": ids}, either with an
    optional "cache_salt" (SamplingParams.cache_salt) -> (the prompt, the salt). Other keys
    (multimodal data, prompt embeddings, ...) are a ValueError naming them."""
    unknown = sorted(set(prompt) - set(PROMPT_DICT_KEYS))
    if unknown:
        raise ValueError(f"prompt dict keys {unknown} are not supported (it takes {', '.join(PROMPT_DICT_KEYS)})")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError('a prompt dict has exactly one of "prompt" (text) and "prompt_token_ids"')
    if "prompt" in prompt and not isinstance(prompt["prompt"], str):
        raise ValueError('a prompt dict\'s "prompt" must be a string (token ids go in "prompt_token_ids")')
    if "prompt_token_ids" in prompt and not isinstance(prompt["prompt_token_ids"], (list, tuple)):
        raise ValueError('a prompt dict\'s "prompt_token_ids" must be a list of token ids')
    return prompt.get("prompt", prompt.get("prompt_token_ids")), prompt.get("cache_salt")
