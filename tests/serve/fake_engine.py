"""An in-process EngineClient with no model: each request "generates" a deterministic token
sequence at once. Lets the app run inside the test process (schemathesis, fast unit tests)."""

from __future__ import annotations

import asyncio

from kiln.cluster.engine_client import EngineOverloaded, OutputStream
from kiln.cluster.messages import WorkerStats
from kiln.engine.contract import EngineCoreOutput, TokenLogprobs
from kiln.engine.core import EngineRequest
from kiln.engine.limits import EngineLimits


class FakeEngineClient:
    """EngineClient: ready at once; every request emits min(max_tokens, 8) tokens."""

    def __init__(self, vocab_size: int, max_model_len: int = 256, capacity: int = 64):
        self.limits = EngineLimits(max_model_len=max_model_len, vocab_size=vocab_size,
                                   block_size=16, num_kv_blocks=1024)
        self.capacity = capacity
        self.stats = WorkerStats(kv_blocks_total=1024)
        self.fatal_error: str | None = None
        self.ready = True
        self.num_restarts = 0
        self.aborted: list[str] = []
        self._open: dict[str, OutputStream] = {}

    @property
    def num_open(self) -> int:
        return len(self._open)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.fail_all("closed")

    def submit(self, requests: list[EngineRequest]) -> OutputStream:
        if self.num_open + len(requests) > self.capacity:
            raise EngineOverloaded("full")
        stream = OutputStream([r.request_id for r in requests], self.abort)
        for r in requests:
            self._open[r.request_id] = stream
            asyncio.get_running_loop().call_soon(self._generate, r)
        return stream

    def _generate(self, r: EngineRequest) -> None:
        stream = self._open.pop(r.request_id, None)
        if stream is None:
            return
        n = min(r.params.max_tokens or 8, 8)
        last = r.prompt_token_ids[-1]
        tokens = [(last + i + 1) % self.limits.vocab_size for i in range(n)]
        stream.deliver(EngineCoreOutput(
            r.request_id, tokens, logprobs=self._logprobs(tokens, r.params.logprobs),
            prompt_logprobs=self._logprobs(r.prompt_token_ids[1:], r.params.prompt_logprobs),
            finish_reason="length"))

    @staticmethod
    def _logprobs(tokens: list[int], k: int | None) -> list[TokenLogprobs] | None:
        if k is None:
            return None
        return [TokenLogprobs(t, -1.0, 1, [t] * k, [-1.0] * k) for t in tokens]

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for rid in request_ids:
            self._open.pop(rid, None)

    def fail_all(self, reason: str) -> None:
        self._open.clear()
