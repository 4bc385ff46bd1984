"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

`StreamingClient.send` posts a request with `stream: true` and usage in the last chunk, times
the chunks that carry content (first one -> TTFT, each later one -> an ITL gap, the last one ->
E2E), reads token counts from `usage`, and turns every failure into an error kind rather than
an exception. The caller owns the `httpx.AsyncClient`'s lifetime (`async with`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kiln.bench.config import Endpoint, ServerConfig
from kiln.bench.metrics import ErrorKind, RequestRecord
from kiln.bench.workloads import Message

_DETAIL_CHARS = 300


@dataclass(frozen=True)
class RequestSpec:
    request_id: int
    session_id: int
    turn: int
    messages: tuple[Message, ...]  # the whole conversation sent with this request
    max_tokens: int
    expected_prompt_tokens: int


@dataclass(frozen=True)
class StreamResult:
    record: RequestRecord
    text: str  # the streamed reply (multi-turn sends it back as the assistant message)


class StreamError(Exception):
    """Ends a stream early with an error kind (internal to this module)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail[:_DETAIL_CHARS]


@dataclass
class _Stream:
    """What a stream has shown so far; timestamps are perf_counter seconds."""

    sent_at: float
    first_at: float | None = None
    last_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None  # the JSON boundary: the server's usage object
    done: bool = False
    # first and last chunk that carried a choice, text or not: the times of a reply whose
    # tokens all decode to no text (special tokens under ignore_eos), as vLLM's client times it
    choice_first_at: float | None = None
    choice_last_at: float | None = None

    def content(self, piece: str, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        else:
            assert self.last_at is not None
            self.gaps.append(now - self.last_at)
        self.last_at = now
        self.text.append(piece)


def request_body(server: ServerConfig, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model, "max_tokens": spec.max_tokens, "temperature": server.temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if server.ignore_eos:
        body["ignore_eos"] = True
    if server.endpoint is Endpoint.CHAT:
        body["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
    else:
        body["prompt"] = "".join(m.content for m in spec.messages)
    return body


class StreamingClient:
    """Sends `RequestSpec`s to one server. `count_tokens` sizes replies when the server sends no
    usage; `clock_zero` is the run's start on the perf_counter clock."""

    def __init__(self, http: httpx.AsyncClient, server: ServerConfig,
                 count_tokens: Callable[[str], int], clock_zero: float,
                 headers: dict[str, str] | None = None):
        self.http = http
        self.server = server
        self.count_tokens = count_tokens
        self.clock_zero = clock_zero
        self.headers = headers or {}

    async def send(self, spec: RequestSpec) -> StreamResult:
        stream = _Stream(sent_at=time.perf_counter())
        try:
            await asyncio.wait_for(self._stream(spec, stream), self.server.request_timeout_s)
            error = _final_check(stream)
        except StreamError as exc:
            error = exc
        except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
            error = StreamError(ErrorKind.TIMEOUT, repr(exc))
        except httpx.TransportError as exc:
            error = StreamError(ErrorKind.CONNECTION, repr(exc))
        except httpx.HTTPError as exc:
            error = StreamError(ErrorKind.PROTOCOL, repr(exc))
        return StreamResult(self._record(spec, stream, error), "".join(stream.text))

    async def _stream(self, spec: RequestSpec, stream: _Stream) -> None:
        body = request_body(self.server, spec)
        async with self.http.stream("POST", self.server.url, json=body,
                                    headers=self.headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                raise StreamError(ErrorKind.http(response.status_code), detail)
            event = ""
            async for line in response.aiter_lines():
                event = self._line(line, event, stream)
                if stream.done:
                    return

    def _line(self, line: str, event: str, stream: _Stream) -> str:
        """Handle one SSE line; returns the pending `event:` name for the next data line."""
        if line.startswith("event:"):
            return line[6:].strip()
        if not line.startswith("data:"):
            return event
        data = line[5:].strip()
        if data == "[DONE]":
            stream.done = True
            return ""
        if event == "error":
            raise StreamError(ErrorKind.SSE_ERROR, data)
        self._chunk(_parse(data), stream)
        return ""

    def _chunk(self, chunk: dict[str, Any], stream: _Stream) -> None:
        if chunk.get("error"):
            raise StreamError(ErrorKind.SSE_ERROR, json.dumps(chunk["error"]))
        now = time.perf_counter()
        piece = self._content(chunk)
        if piece:
            stream.content(piece, now)
        if chunk.get("choices"):
            stream.choice_first_at = stream.choice_first_at or now
            stream.choice_last_at = now
        if chunk.get("usage"):
            stream.usage = chunk["usage"]

    def _content(self, chunk: dict[str, Any]) -> str:
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        if self.server.endpoint is Endpoint.CHAT:
            return (choices[0].get("delta") or {}).get("content") or ""
        return choices[0].get("text") or ""

    def _record(self, spec: RequestSpec, stream: _Stream, error: StreamError | None) -> RequestRecord:
        base = RequestRecord(
            request_id=spec.request_id, session_id=spec.session_id, turn=spec.turn,
            start_s=stream.sent_at - self.clock_zero, max_tokens=spec.max_tokens,
            expected_prompt_tokens=spec.expected_prompt_tokens)
        if error is not None:
            return replace(base, error=error.kind, error_detail=error.detail)
        assert stream.first_at is not None and stream.last_at is not None
        usage = stream.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        output = usage.get("completion_tokens")
        return replace(
            base, ttft_s=stream.first_at - stream.sent_at, e2e_s=stream.last_at - stream.sent_at,
            itl_s=tuple(stream.gaps), prompt_tokens=usage.get("prompt_tokens"),
            output_tokens=output if output is not None else self.count_tokens("".join(stream.text)),
            cached_tokens=details.get("cached_tokens"))


def _parse(data: str) -> dict[str, Any]:
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise StreamError(ErrorKind.BAD_CHUNK, data) from None
    if not isinstance(chunk, dict):
        raise StreamError(ErrorKind.BAD_CHUNK, data)
    return chunk


def _final_check(stream: _Stream) -> StreamError | None:
    if not stream.done:
        return StreamError(ErrorKind.INCOMPLETE, "the stream closed before data: [DONE]")
    if stream.first_at is None:
        tokens = (stream.usage or {}).get("completion_tokens") or 0
        if not tokens or stream.choice_first_at is None:
            return StreamError(ErrorKind.NO_OUTPUT, "the stream carried no content")
        # tokens without text: a reply, timed by its choice-bearing chunks
        stream.first_at, stream.last_at = stream.choice_first_at, stream.choice_last_at
    return None


def make_http_client(server: ServerConfig) -> httpx.AsyncClient:
    """An HTTP client with no connection cap (the load shape, not the pool, limits requests)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(server.request_timeout_s, connect=min(30.0, server.request_timeout_s))
    return httpx.AsyncClient(limits=limits, timeout=timeout)
