"""What one step produces: the runner's sampled tokens and the engine's per-request outputs.

`EngineCoreOutput` is a msgspec Struct because it crosses from the worker process to the
gateway unchanged; `RunnerOutput` stays inside the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RunnerOutput:
    """Per scheduled request, in `SchedulerOutput.scheduled` order."""

    sampled_token_ids: list[list[int]]  # accepted drafts + one new token; [] if not sampling
    logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None
