"""The offline API, with vLLM's names: `LLM(model).generate(prompts, SamplingParams(...))`.

Runs an EngineCore in this process with no HTTP. Tokenization, incremental detokenization,
stop strings and the fan-out of `n > 1` into child sequences (which share the prompt's KV
blocks through the prefix cache) happen here, outside the step loop.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from kiln.engine.core import EngineCore, EngineRequest, RequestError
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.outputs import EngineCoreOutput, TokenLogprobs
from kiln.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kiln.sampling_params import SamplingParams

PromptInput = str | list[int] | dict


@dataclass
class _Sequence:
    """One output sequence (a child of a request when n > 1)."""

    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Pending:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, _Sequence]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 max_model_len: int | None = None, kv_cache_memory: int | None = None,
                 enable_prefix_caching: bool = True, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True, scheduling_policy: str = "fcfs",
                 quantization: str | None = None, seed: int = 0,
                 num_threads: int | None = None, tokenizer: str | None = None,
                 kernels: str = "auto"):
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                              quantization=quantization, kernels=kernels),
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      policy=scheduling_policy),
            parallel=ParallelConfig(num_threads=num_threads))
        self.engine = EngineCore(config)
        self.tokenizer = load_tokenizer(tokenizer or self.engine.model_path)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    # -- public API -----------------------------------------------------------------------

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _broadcast(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _broadcast(list(priority) if priority else 0, len(prompts), "priority")
        tokenized = [self._tokenize(p) for p in prompts]
        for (_, ids), sp in zip(tokenized, params, strict=True):
            self.engine.validate(ids, sp)  # all or nothing: validate before adding any
        pending = [self._add(t, sp, pr) for t, sp, pr in zip(tokenized, params, priorities,
                                                               strict=True)]
        self._run(pending, use_tqdm)
        return [self._request_output(p) for p in pending]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt,
                                                                 chat_template_kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            kwargs: dict | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use generate()",
                               param="messages")
        ids = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
            **(kwargs or {}))
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    # -- internals ------------------------------------------------------------------------

    def _add(self, tokenized: tuple[str | None, list[int]], params: SamplingParams,
             priority: int) -> _Pending:
        text, ids = tokenized
        rid = str(next(self._ids))
        sequences = {}
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i)
            child_id = rid if params.n == 1 else f"{rid}_{i}"
            self.engine.add_request(EngineRequest(request_id=child_id, prompt_token_ids=ids,
                                                  params=child_params, priority=priority))
            sequences[child_id] = _Sequence(i, IncrementalDetokenizer(self.tokenizer, params))
        prompt_lp = [None] if params.prompt_logprobs is not None else None
        return _Pending(rid, text, ids, params, sequences, prompt_lp)

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'",
                               param="prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise RequestError(f"unsupported prompt type {type(prompt).__name__}", param="prompt")

    def _run(self, pending: list[_Pending], use_tqdm: bool) -> None:
        owner = {cid: p for p in pending for cid in p.sequences}
        from rich.progress import Progress
        show = use_tqdm and sys.stderr.isatty()
        with Progress(disable=not show, transient=True) as progress:
            task = progress.add_task("generating", total=len(pending))
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    p = owner.get(out.request_id)
                    if p is not None:
                        was_done = p.finished
                        self._absorb(p, out)
                        progress.advance(task, int(p.finished and not was_done))

    def _absorb(self, p: _Pending, out: EngineCoreOutput) -> None:
        seq = p.sequences[out.request_id]
        if out.prompt_logprobs and p.prompt_logprobs is not None and seq.index == 0:
            p.prompt_logprobs.extend(self._positions(out.prompt_logprobs))
        if seq.finish_reason is not None:
            return  # already ended by a stop string; this is the engine's abort echo
        p.num_cached_tokens = max(p.num_cached_tokens, out.num_cached_tokens)
        p.num_draft_tokens += out.num_draft_tokens
        p.num_accepted_tokens += out.num_accepted_tokens
        seq.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            self._add_logprobs(seq, out.logprobs)
        if seq.detok.add_tokens(out.new_token_ids):
            seq.finish_reason, seq.stop_reason = "stop", seq.detok.stop_string
            if not out.finished:
                self.engine.abort_requests([out.request_id])
        elif out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason

    def _add_logprobs(self, seq: _Sequence, entries: list[TokenLogprobs]) -> None:
        if seq.logprobs is None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        seq.logprobs.extend(self._positions(entries))
        seq.cumulative_logprob += sum(e.logprob for e in entries)

    def _positions(self, entries: list[TokenLogprobs]) -> list[PositionLogprobs]:
        decode = self.tokenizer.decode
        out = []
        for e in entries:
            pos = {tid: Logprob(lp, rank + 1, decode([tid]))
                   for rank, (tid, lp) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True))}
            pos.setdefault(e.token_id, Logprob(e.logprob, e.rank, decode([e.token_id])))
            out.append(pos)
        return out

    def _request_output(self, p: _Pending) -> RequestOutput:
        outputs = [CompletionOutput(s.index, s.detok.text, s.token_ids, s.cumulative_logprob,
                                    s.logprobs, s.finish_reason, s.stop_reason)
                   for s in sorted(p.sequences.values(), key=lambda s: s.index)]
        metrics = {}
        if p.num_draft_tokens:
            metrics = {"num_draft_tokens": p.num_draft_tokens,
                       "num_accepted_tokens": p.num_accepted_tokens}
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, p.prompt_logprobs,
                             outputs, p.finished, p.num_cached_tokens, metrics)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _as_prompt_list(prompts) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise RequestError("no prompts given", param="prompt")
    return prompts


def _broadcast(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n
