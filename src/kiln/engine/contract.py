"""The step contract between the engine and the runner, types only: what the scheduler asks
of one step (`SchedulerOutput`), what the runner returns (`RunnerOutput`) and the engine's
per-request outputs (`EngineCoreOutput`).

The runner imports only this module from kiln.engine; it imports only shared leaves.
`EngineCoreOutput` is a msgspec Struct because it crosses from the worker process to the
gateway unchanged; `RunnerOutput` stays inside the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kiln.sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of one chosen token plus the top alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprobs] | None = None  # for prompt tokens of this chunk
    finish_reason: str | None = None  # stop | length | abort | repetition | error
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # drafts verified this step
    num_accepted_tokens: int = 0  # of which were accepted
    draft_source: str | None = None  # who drafted them: "ngram" (lookup), "draft", "head"
    num_redraws: int = 0  # tokens the repetition guard dropped and sampled again (retry mode)
    draft_depth: int = 0  # a draft tree's depth (positions drafted); 0: a chain's, = num_draft
    num_closing_steered: int = 0  # new tokens drawn narrowed by the JSON closing budget

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RunnerOutput:
    """Per scheduled request, in `SchedulerOutput.scheduled` order."""

    sampled_token_ids: list[list[int]]  # accepted drafts + one new token; [] if not sampling
    logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None


@dataclass
class ScheduledRequest:
    """One request's share of a step. Lists are read-only views valid for this step only."""

    request_id: str
    token_ids: list[int]  # tokens to compute this step; the last `num_draft_tokens` are drafts
    start_pos: int  # position of token_ids[0] = tokens already in the KV cache
    num_draft_tokens: int
    block_ids: list[int]  # the request's whole block table
    samples: bool  # the step reaches the request's last known token, so it yields tokens
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    prompt_logprobs: bool  # compute logprobs of the prompt tokens in this chunk
    grammar: object | None = None  # structured-output matcher (kiln.structured), if any
    draft_probs: object | None = None  # the proposer's q for the scheduled drafts, if any
    # the scheduled drafts' parents (-1: the last known token; else an earlier draft's index)
    # when they form a tree; None: a chain (each draft follows the one before)
    draft_parents: list[int] | None = None
    # data-parallel attention: the rank whose KV pool holds the request (block_ids index it)
    dp_rank: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    finished_ids: list[str] = field(default_factory=list)  # runner may drop their state

    @property
    def empty(self) -> bool:
        return not self.scheduled


def tree_depths(parents: list[int]) -> list[int]:
    """Each draft's depth in a tree given its parent (-1 = the root; parents come first)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths
