"""What a request must satisfy to be served by an engine: the engine's limits and the one check.

The engine core checks every request it is given against its own limits. The gateway holds the
same `EngineLimits` (each worker sends them when it is ready) and runs the same check before
admission, so a request that can never be served gets its 400 without a round trip to a worker,
with the same message and `code`.
"""

from __future__ import annotations

import msgspec

from kiln.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take; `param` and `code` follow the OpenAI error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class EngineLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The sizes a request is checked against; fixed for the life of an engine."""

    max_model_len: int  # prompt + output tokens of one sequence
    vocab_size: int  # prompt token ids must lie in [0, vocab_size)
    block_size: int  # tokens per KV block
    num_kv_blocks: int  # blocks in the whole KV pool

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def validate_request(limits: EngineLimits, prompt_token_ids: list[int],
                     params: SamplingParams) -> None:
    """Raise RequestError for a prompt these limits can never serve (nothing is mutated)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError("the prompt is empty", param="prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary "
                           f"[0, {limits.vocab_size})", param="prompt")
    max_tokens = params.max_tokens or 1
    if n + max_tokens > limits.max_model_len:
        raise RequestError(
            f"this model's maximum context length is {limits.max_model_len} tokens, but the "
            f"request needs {n + max_tokens} ({n} in the prompt + {max_tokens} to generate)",
            param="max_tokens" if n < limits.max_model_len else "prompt",
            code="context_length_exceeded")
    blocks = limits.blocks_needed(n + max_tokens)
    if blocks > limits.num_kv_blocks:
        raise RequestError(
            f"the request needs {blocks} KV blocks but the cache holds "
            f"{limits.num_kv_blocks}; lower max_tokens or raise kv_cache_memory",
            param="max_tokens", code="context_length_exceeded")
