"""Engine outputs -> per-sequence text, tokens and logprobs. Shared by `LLM` and the gateway.

A request with `n > 1` fans out into `n` engine requests `"{id}_{i}"`: the children share the
prompt's KV blocks through the prefix cache, and seeded children get `seed + i` so they differ
yet stay reproducible. Each child's `EngineCoreOutput`s feed one `OutputSequence`, which
detokenizes incrementally and applies stop strings. When a stop string ends a sequence before
the engine did, `absorb` returns True and the caller must abort that child in the engine; the
engine's echo of that abort is then ignored.

Runs where the tokenizer lives (the gateway process, or the offline `LLM`), never in the step
loop. Logprobs stay as raw `TokenLogprobs`; each API converts them to its own shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.engine.contract import EngineCoreOutput, TokenLogprobs
from kiln.engine.core import EngineRequest
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.sampling_params import SamplingParams


def fan_out(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 0, cache_salt: str | None = None) -> list[EngineRequest]:
    """The engine requests for one prompt: itself when n == 1, else n children of n = 1."""
    if params.n == 1:
        return [EngineRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                              params=params, priority=priority, cache_salt=cache_salt)]
    return [EngineRequest(request_id=f"{request_id}_{i}", prompt_token_ids=prompt_token_ids,
                          params=params.clone(n=1, seed=None if params.seed is None
                                              else params.seed + i),
                          priority=priority, cache_salt=cache_salt)
            for i in range(params.n)]


@dataclass
class SequenceDelta:
    """What one sequence gained since the previous `take_delta` (text is stop-string safe)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


class OutputSequence:
    """One output sequence: its tokens, text, logprobs and how it ended."""

    def __init__(self, index: int, detok: IncrementalDetokenizer):
        self.index = index
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0  # prompt tokens this child found in the prefix cache
        self.num_closing_steered = 0  # tokens drawn narrowed by the JSON closing budget
        self._taken = 0  # tokens already handed out by take_delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.text

    def absorb(self, out: EngineCoreOutput) -> bool:
        """Fold one engine output in. True if a stop string ended the sequence while the
        engine still runs it: the caller must abort `out.request_id`."""
        if self.finished:
            return False  # the engine's echo of an abort we asked for
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.num_closing_steered += out.num_closing_steered
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            self._add_logprobs(out.logprobs)
        if self.detok.add_tokens(out.new_token_ids):
            self.finish_reason, self.stop_reason = "stop", self.detok.stop_string
            return not out.finished
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _add_logprobs(self, entries: list[TokenLogprobs]) -> None:
        if self.logprobs is None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        self.logprobs.extend(entries)
        self.cumulative_logprob += sum(e.logprob for e in entries)

    def take_delta(self) -> SequenceDelta:
        """New text, tokens and logprobs since the last call; text holds back a possible
        stop-string prefix until the sequence finishes."""
        start, self._taken = self._taken, len(self.token_ids)
        logprobs = self.logprobs[start:self._taken] if self.logprobs is not None else None
        return SequenceDelta(self.index, self.detok.take_delta(self.finished),
                             self.token_ids[start:self._taken], logprobs,
                             self.finish_reason, self.stop_reason)


@dataclass
class RequestState:
    """One prompt's request: its output sequences keyed by engine request id."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, OutputSequence]
    prompt_logprobs: list[TokenLogprobs] | None  # prompt positions 1.. (position 0 has none)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0  # sequence-steps that verified drafts (speculative decoding)
    # per draft position i (0 = the first draft of a step): steps that verified a draft there,
    # and steps that accepted it
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # per draft source ("ngram", "draft", "head"): [drafts verified, accepted]
    drafts_by_source: dict[str, list[int]] = field(default_factory=dict)
    engine_requests: list[EngineRequest] = field(default_factory=list)

    @classmethod
    def create(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               tokenizer, priority: int = 0, cache_salt: str | None = None) -> RequestState:
        """The state and (in `engine_requests`) the engine requests to submit for it."""
        children = fan_out(request_id, prompt_token_ids, params, priority, cache_salt)
        sequences = {c.request_id: OutputSequence(i, IncrementalDetokenizer(tokenizer, params))
                     for i, c in enumerate(children)}
        prompt_lp = [] if params.prompt_logprobs is not None else None
        return cls(request_id, prompt_token_ids, params, sequences, prompt_lp,
                   engine_requests=children)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences.values())

    @property
    def num_cached_tokens(self) -> int:
        """Most prompt tokens any child found cached (later children hit the first's blocks)."""
        return max(s.num_cached_tokens for s in self.sequences.values())

    @property
    def num_closing_steered(self) -> int:
        """Tokens of all sequences the JSON closing budget narrowed (kiln.structured.closing)."""
        return sum(s.num_closing_steered for s in self.sequences.values())

    def ordered(self) -> list[OutputSequence]:
        return sorted(self.sequences.values(), key=lambda s: s.index)

    def absorb(self, out: EngineCoreOutput) -> bool:
        """Route one engine output to its sequence; True means abort `out.request_id`."""
        seq = self.sequences[out.request_id]
        if out.prompt_logprobs and self.prompt_logprobs is not None and seq.index == 0:
            self.prompt_logprobs.extend(out.prompt_logprobs)
        if not seq.finished:
            self.num_draft_tokens += out.num_draft_tokens
            self.num_accepted_tokens += out.num_accepted_tokens
            self.num_verify_steps += int(out.num_draft_tokens > 0)
            count_positions(self.drafted_per_position, out.draft_depth or out.num_draft_tokens)
            count_positions(self.accepted_per_position, out.num_accepted_tokens)
            if out.draft_source is not None:
                counts = self.drafts_by_source.setdefault(out.draft_source, [0, 0])
                counts[0] += out.num_draft_tokens
                counts[1] += out.num_accepted_tokens
        return seq.absorb(out)


def count_positions(counts: list[int], n: int) -> None:
    """Add one to positions 0..n-1 of `counts`, growing it as needed."""
    counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1
