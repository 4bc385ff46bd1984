"""The offline API, with vLLM's names: `LLM(model).generate(prompts, SamplingParams(...))`.

Runs an EngineCore in this process with no HTTP. Tokenization, incremental detokenization,
stop strings and the fan-out of `n > 1` into child sequences (which share the prompt's KV
blocks through the prefix cache) happen here, outside the step loop.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kiln.assembly import build_engine_core
from kiln.config import EngineConfig, engine_config_from, setting_sections, unknown_setting
from kiln.config_speculative import SpeculativeConfig
from kiln.engine.contract import TokenLogprobs
from kiln.engine.core import RequestError
from kiln.engine.output_processor import OutputSequence, RequestState
from kiln.models.layers.expert_parallel import ExpertLoad, model_expert_load
from kiln.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kiln.sampling_params import SamplingParams
from kiln.speculative.resolve import resolve_speculative_config

PromptInput = str | list[int] | dict
# vLLM's names for settings kiln's configs call otherwise
VLLM_SETTINGS = {"scheduling_policy": "policy"}
LLM_KEYWORDS = ("tokenizer", "speculator", "speculative_config")  # LLM's own, beside settings



class LLM:
    """An engine in this process. `LLM(model, **settings)`: `settings` are the engine configs'
    fields by name (kiln.config.engine_config_from: dtype, max_model_len, kv_cache_memory,
    enable_prefix_caching, block_size, max_num_seqs, max_num_batched_tokens,
    enable_chunked_prefill, policy or vLLM's scheduling_policy, quantization, seed,
    num_threads, kernels, linear_backend, tensor_parallel_size, repetition_guard, ...); an
    unknown one is a TypeError naming the closest. `speculator` or `speculative_config` turns on speculative
    decoding (kiln.speculative.resolve); `tokenizer` defaults to the model's."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 speculator: str | None = None,
                 speculative_config: SpeculativeConfig | Mapping | None = None,
                 **settings: object):
        config = engine_config_from({"model": model, **_kiln_names(settings)})
        speculative = resolve_speculative_config(speculator, speculative_config)
        self._start(config.replace(speculative=speculative), tokenizer)

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer: str | None = None) -> LLM:
        """An LLM over a whole EngineConfig (`kiln generate` builds one from its flags)."""
        llm = cls.__new__(cls)
        llm._start(config, tokenizer)
        return llm

    def _start(self, config: EngineConfig, tokenizer: str | None) -> None:
        self.engine = build_engine_core(config)
        self.tokenizer = load_tokenizer(tokenizer or self.engine.model_path)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def expert_load(self) -> ExpertLoad | None:
        """Tokens routed to each expert of each MoE layer since the engine started, with the
        imbalance figures (None: a dense model). `.save(path)` writes the file that
        `expert_load_file` reads to place experts (docs/moe.md, "Expert parallelism")."""
        return model_expert_load(self.engine.runner.model)

    def close(self) -> None:
        """Stop the engine's other ranks (tensor_parallel_size > 1; they also stop when this
        process exits). The LLM cannot generate afterwards."""
        self.engine.runner.close()

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
        state = RequestState.create(str(next(self._ids)), ids, params, self.tokenizer, priority)
        for child in state.engine_requests:
            self.engine.add_request(child)
        return _Pending(state, text)

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
        owner = {cid: p.state for p in pending for cid in p.state.sequences}
        from rich.progress import Progress
        show = use_tqdm and sys.stderr.isatty()
        with Progress(disable=not show, transient=True) as progress:
            task = progress.add_task("generating", total=len(pending))
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    state = owner.get(out.request_id)
                    if state is None:
                        continue
                    was_done = state.finished
                    if state.absorb(out):  # a stop string ended it first
                        self.engine.abort_requests([out.request_id])
                    progress.advance(task, int(state.finished and not was_done))

    def _positions(self, entries: list[TokenLogprobs]) -> list[PositionLogprobs]:
        decode = self.tokenizer.decode
        out = []
        for e in entries:
            pos = {tid: Logprob(lp, rank + 1, decode([tid]))
                   for rank, (tid, lp) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True))}
            pos.setdefault(e.token_id, Logprob(e.logprob, e.rank, decode([e.token_id])))
            out.append(pos)
        return out

    def _completion(self, s: OutputSequence) -> CompletionOutput:
        logprobs = self._positions(s.logprobs) if s.logprobs is not None else None
        return CompletionOutput(s.index, s.text, s.token_ids, s.cumulative_logprob, logprobs,
                                s.finish_reason, s.stop_reason)

    def _request_output(self, p: _Pending) -> RequestOutput:
        st = p.state
        prompt_lp = None
        if st.prompt_logprobs is not None:
            prompt_lp = [None, *self._positions(st.prompt_logprobs)]
        metrics = {}
        if st.num_draft_tokens:
            metrics = {"num_draft_tokens": st.num_draft_tokens,
                       "num_accepted_tokens": st.num_accepted_tokens,
                       "num_verify_steps": st.num_verify_steps,
                       "mean_accepted_length": st.num_accepted_tokens / st.num_verify_steps,
                       "drafted_per_position": list(st.drafted_per_position),
                       "accepted_per_position": list(st.accepted_per_position),
                       "drafts_by_source": {k: list(v) for k, v in
                                            st.drafts_by_source.items()}}
        if st.num_closing_steered:  # the JSON closing budget narrowed it (kiln.structured)
            metrics["json_closing_steered"] = st.num_closing_steered
        return RequestOutput(st.request_id, p.prompt, st.prompt_token_ids, prompt_lp,
                             [self._completion(s) for s in st.ordered()], st.finished,
                             st.num_cached_tokens, metrics)


class _Pending(NamedTuple):
    state: RequestState
    prompt: str | None  # the prompt text, when the caller gave text


def _kiln_names(settings: Mapping[str, object]) -> dict[str, object]:
    """`settings` with vLLM's names (VLLM_SETTINGS) replaced by the config fields'; TypeError
    for a name that is neither, suggesting the closest keyword LLM takes."""
    renamed = {}
    for name, value in settings.items():
        field_name = VLLM_SETTINGS.get(name, name)
        if field_name not in setting_sections():
            known = [*setting_sections(), *VLLM_SETTINGS, *LLM_KEYWORDS]
            raise TypeError(f"LLM(): {unknown_setting(name, known)}")
        if field_name in renamed:
            raise TypeError(f"LLM(): {name!r} and {field_name!r} are the same setting")
        renamed[field_name] = value
    return renamed


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
