"""A fake OpenAI-style streaming server with known delays, for tests and demos of `kiln bench`.

It streams `max_tokens` one-token chunks: the first after `ttft_s`, each next one `itl_s`
later, then a usage chunk and `data: [DONE]`. Prompt tokens are counted as whitespace-separated
words (or by `count_tokens`). It records every request body it receives, and can fail requests
on purpose. Run it in a background thread with `with FakeServer(spec) as server:`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass(frozen=True)
class FakeServerSpec:
    ttft_s: float = 0.05  # delay before the first content chunk
    itl_s: float = 0.01  # delay between content chunks
    cached_fraction: float = 0.0  # reported cached_tokens = this share of prompt_tokens
    report_usage: bool = True  # send the final usage chunk
    fail_every: int | None = None  # every k-th request (1-based) answers HTTP 503
    sse_error_every: int | None = None  # every k-th request sends an SSE error after 1 chunk


class FakeServer:
    """The fake server; `requests` holds the JSON bodies received, in arrival order."""

    def __init__(self, spec: FakeServerSpec | None = None,
                 count_tokens: Callable[[str], int] | None = None):
        self.spec = spec or FakeServerSpec()
        self.count_tokens = count_tokens or (lambda text: len(text.split()))
        self.requests: list[dict[str, Any]] = []
        self.app = self._make_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        self._wait_started()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def _wait_started(self, timeout_s: float = 10.0) -> None:
        assert self._server is not None
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._handle(request, chat=True)

        return app

    async def _handle(self, request: Request, chat: bool) -> Response:
        body = await request.json()
        self.requests.append(body)
        index = len(self.requests)
        if self.spec.fail_every and index % self.spec.fail_every == 0:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        broken = bool(self.spec.sse_error_every and index % self.spec.sse_error_every == 0)
        return StreamingResponse(self._events(body, chat, broken), media_type="text/event-stream")

    async def _events(self, body: dict[str, Any], chat: bool, broken: bool) -> AsyncIterator[str]:
        await asyncio.sleep(self.spec.ttft_s)
        n = int(body.get("max_tokens") or 16)
        for i in range(n):
            if i > 0:
                await asyncio.sleep(self.spec.itl_s)
            yield _sse(_chunk(f"t{i} ", chat))
            if broken:
                yield _sse({"error": {"message": "engine died", "code": 500}})
                return
        if self.spec.report_usage:
            yield _sse({"choices": [], "usage": self._usage(body, n)})
        yield "data: [DONE]\n\n"

    def _usage(self, body: dict[str, Any], completion_tokens: int) -> dict[str, Any]:
        if "messages" in body:
            text = " ".join(m["content"] for m in body["messages"])
        else:
            text = body["prompt"]
        prompt = self.count_tokens(text)
        cached = int(prompt * self.spec.cached_fraction)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _chunk(text: str, chat: bool) -> dict[str, Any]:
    if chat:
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
