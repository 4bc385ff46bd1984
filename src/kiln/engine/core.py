"""EngineCore: the step loop's body. schedule -> run -> update, plus add and abort.

`step()` is synchronous and single-threaded; the worker process (kiln.cluster) and the offline
`LLM` both drive it. Requests enter as `EngineRequest` (token ids, already validated against
the model's limits here) and leave as `EngineCoreOutput`s carrying new token ids.

Features plug in through the protocols below, which say what the engine calls on them;
the engine imports none of them. `kiln.assembly.build_engine_core` is where they are chosen
and built: structured output (`StructuredOutput`, from kiln.structured) and a speculator
(`Speculation`, from kiln.speculative). Without them the engine decodes plainly.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

from kiln.config import EngineConfig
from kiln.engine.contract import EngineCoreOutput, RunnerOutput, SchedulerOutput
from kiln.engine.dp_kv import kv_manager_for
from kiln.engine.kv_manager import KVCacheStats
from kiln.engine.limits import EngineLimits, validate_request
from kiln.engine.limits import RequestError as RequestError  # re-exported: its old home
from kiln.engine.pipelined import StepPipeline
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import KEEP, Scheduler, TokenCheck
from kiln.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# (request, its drafts) -> how many leading drafts to keep
DraftFilter = Callable[[Request, list[int]], int]


class StructuredOutput(Protocol):
    """Grammars and the repetition guard, as the engine calls them (kiln.structured's
    `StructuredHooks`). Lifecycle: `validate` (optional) and `attach` when a request arrives,
    `check_token` on each sampled token (the scheduler's `TokenChecker`), `draft_filter` on
    each draft (the speculator's), `wait_for_compile` when a step had nothing to run."""

    def validate(self, params: SamplingParams) -> None:
        """Raise RequestError if the request's constraints can never be used."""

    def attach(self, request: Request) -> None:
        """Give a new request its grammar and guard state (may not block on a compile)."""

    def check_token(self, request: Request, token: int) -> TokenCheck:
        """The verdict on `token`, sampled for `request` and not yet appended."""

    def draft_filter(self, request: Request, drafts: list[int]) -> int:
        """How many leading `drafts` the request's constraints allow."""

    def wait_for_compile(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for any grammar still compiling."""


class Speculation(Protocol):
    """A speculator (kiln.speculative): after each step, it sets the running requests'
    drafts (`Request.spec_token_ids`) for the next one."""

    draft_filter: DraftFilter | None  # the engine installs structured output's

    def after_step(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput],
                   step_seconds: float) -> None:
        """Called once per step that ran, after `Scheduler.update` (verified tokens only)."""


class StructuredFactory(Protocol):
    def __call__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> StructuredOutput: ...


# builds the speculator once the engine has its runner and scheduler (it reads both)
SpeculationFactory = Callable[["EngineCore"], Speculation]


class PlainOutput:
    """Structured output for an engine built without it: every token kept, every draft
    allowed, and a request that asks for a grammar refused."""

    def validate(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            raise RequestError("this engine was built without structured output",
                               param="structured_outputs")

    def attach(self, request: Request) -> None:
        self.validate(request.params)

    def check_token(self, request: Request, token: int) -> TokenCheck:
        return KEEP

    def draft_filter(self, request: Request, drafts: list[int]) -> int:
        return len(drafts)

    def wait_for_compile(self, timeout_s: float) -> None:
        pass


def plain_output(vocab_size: int, eos_token_ids: frozenset[int]) -> StructuredOutput:
    return PlainOutput()


class EngineRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    # tokens this request already produced elsewhere: it resumes after them (a migrated
    # request, or a decode after a remote prefill); they count against max_tokens
    output_token_ids: list[int] = []


@dataclass
class StepStats:
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    kv: KVCacheStats
    num_preemptions: int


def resolve_model_path(model: str | None) -> str:
    if model is None:
        from kiln.models.default import default_model_path
        return str(default_model_path())
    return model


def eos_token_ids(model_path: str, hf_config: dict) -> frozenset[int]:
    """EOS ids from generation_config.json (which may list several), else config.json."""
    ids = hf_config.get("eos_token_id")
    gen_file = Path(model_path) / "generation_config.json"
    if gen_file.is_file():
        ids = json.loads(gen_file.read_text()).get("eos_token_id", ids)
    if ids is None:
        return frozenset()
    return frozenset(ids if isinstance(ids, list) else [ids])


class EngineCore:
    def __init__(self, config: EngineConfig, emit_kv_events: bool = False, *,
                 structured: StructuredFactory = plain_output,
                 speculator: SpeculationFactory | None = None):
        """Load the model and size the KV cache; `structured` and `speculator` build the
        features (kiln.assembly passes kiln's; see the module docstring)."""
        from kiln.models.loader import read_hf_config
        from kiln.runner.kv_cache import num_kv_blocks
        from kiln.runner.model_runner import ModelRunner

        self.config = config
        self.model_path = resolve_model_path(config.model.model)
        hf_config = read_hf_config(self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config)
        self.runner = ModelRunner(config.model, self.model_path, config.cache, config.parallel,
                                  self.eos_token_ids)
        self.max_model_len = self._resolve_max_model_len(self.runner.hf_config)
        self.vocab_size = self.runner.vocab_size
        sc = config.scheduler
        num_blocks = num_kv_blocks(self.runner.kv_spec, config.cache, self.max_model_len,
                                   sc.max_num_seqs, self.runner.device_memory(
                                       sc.max_num_batched_tokens, sc.max_num_seqs))
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs(sc.max_num_seqs, self.max_model_len)  # on a GPU only
        # one pool, or one per data-parallel rank (kiln.engine.dp_kv); num_blocks is per rank
        self.kv = kv_manager_for(config.cache, num_blocks, config.parallel.data_parallel_size,
                                 emit_kv_events)
        # grammars (compiled off the step loop) and the repetition guard
        self.structured = structured(self.vocab_size, self.eos_token_ids)
        self.scheduler = Scheduler(self._scheduler_config(), self.kv, self.max_model_len,
                                   token_check=self.structured.check_token)
        self.speculator = self._build_speculator(speculator)  # drafts after each step
        # pipeline parallelism: several steps in flight (kiln.engine.pipelined); else None
        depth = self.runner.pipeline_depth
        self.pipeline = StepPipeline(self.scheduler, self.runner, depth) if depth > 1 else None
        self.limits = EngineLimits(max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                                   block_size=config.cache.block_size, num_kv_blocks=num_blocks)
        log.info("engine ready: %s, %d KV blocks of %d tokens, max_model_len %d",
                 self.model_path, num_blocks, config.cache.block_size, self.max_model_len)

    def _build_speculator(self, factory: SpeculationFactory | None) -> Speculation | None:
        if factory is None:
            if self.config.speculative is not None:
                raise ValueError("config.speculative is set but no speculator was given "
                                 "(kiln.assembly.build_engine_core builds one)")
            return None
        speculator = factory(self)
        speculator.draft_filter = self.structured.draft_filter
        return speculator

    def _resolve_max_model_len(self, hf_config: dict) -> int:
        limit = hf_config.get("max_position_embeddings", 2048)
        window = hf_config.get("sliding_window")
        if window and hf_config.get("use_sliding_window", True) and window < limit:
            log.info("sliding window %d: max_model_len capped to it (no windowed attention)",
                     window)
            limit = window
        wanted = self.config.model.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {limit}")
        return wanted or limit

    def _scheduler_config(self):
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            from dataclasses import replace
            return replace(sc, max_num_batched_tokens=self.max_model_len)
        return sc

    # -- requests -------------------------------------------------------------------------

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request (RequestError if it can never be served). Never blocks: a grammar
        compiles in the background, and one that fails finishes the request with an error."""
        validate_request(self.limits, req.prompt_token_ids, req.params)
        request = Request(req.request_id, req.prompt_token_ids, req.params, self.eos_token_ids,
                          priority=req.priority, cache_salt=req.cache_salt)
        for token in req.output_token_ids:
            request.append_output_token(token)
        self.structured.attach(request)
        self.scheduler.add_request(request)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request this engine can never serve; compiles its grammar
        (so the offline API reports a bad one before adding anything)."""
        validate_request(self.limits, prompt_token_ids, params)
        self.structured.validate(params)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.pipeline is not None:  # one in flight ends when its step does
            request_ids = self.pipeline.defer_busy(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.pipeline and self.pipeline.in_flight)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        if self.pipeline is not None:
            return self._pipelined_step()
        sched = self.scheduler.schedule()
        if sched.empty:
            self.structured.wait_for_compile(0.005)  # waiting requests' grammars, if any
            self.runner.release(sched.finished_ids)
            return self.scheduler.update(sched, RunnerOutput([]))
        started = time.perf_counter()
        outputs = self.scheduler.update(sched, self.runner.execute(sched))
        if self.speculator is not None:
            self.speculator.after_step(sched, outputs, time.perf_counter() - started)
        return outputs

    def _pipelined_step(self) -> list[EngineCoreOutput]:
        started = time.perf_counter()
        finished, outputs = self.pipeline.step()
        if finished is None and not self.pipeline.in_flight:  # idle
            self.structured.wait_for_compile(0.005)
        if finished is not None and self.speculator is not None:
            self.speculator.after_step(finished, outputs, time.perf_counter() - started)
        return outputs

    def stats(self) -> StepStats:
        return StepStats(self.scheduler.num_running, self.scheduler.num_waiting, 0,
                         self.kv.stats(), self.scheduler.num_preemptions)
