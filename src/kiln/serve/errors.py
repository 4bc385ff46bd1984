"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`, and the
mapping from everything that can go wrong in a request to one status code.

400 bad parameters (schema errors included: never 422), bad JSON, bad prompts, and
    `context_length_exceeded`; 401 keys (kiln.serve.auth); 404 unknown model or route;
413 bodies over `--max-body-bytes`; 429 a full admission queue; 503 no worker (starting,
restarting, down, or the server is draining). A 500 only for a bug, with no internals leaked.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.cluster.engine_client import (
    EngineOverloaded,
    EngineUnavailable,
    RequestRejected,
    WorkerLost,
)
from kiln.engine.limits import RequestError
from kiln.sampling_params import SamplingParamsError
from kiln.serve.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("kiln.serve")

TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
         404: "invalid_request_error", 405: "invalid_request_error",
         413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error response: status, message and the OpenAI `type` / `param` / `code`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, param=self.param,
                                             type=TYPES.get(self.status, "server_error"),
                                             code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), self.status, headers=self.headers)

    def sse_event(self) -> bytes:
        """The error as one SSE event, for a stream whose headers are already sent."""
        return b"data: " + self.body().model_dump_json().encode() + b"\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def as_api_error(exc: Exception) -> APIError:
    """Map an exception from any layer to its API error (unknown ones to a bare 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (RequestError, RequestRejected)):
        return APIError(400, str(exc), exc.param, exc.code)
    if isinstance(exc, SamplingParamsError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, EngineOverloaded):
        return APIError(429, str(exc), code="admission_queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, WorkerLost):
        return APIError(503, f"the request was lost: {exc}", code="worker_lost")
    log.error("unexpected error", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


def from_validation_errors(errors: list[dict]) -> APIError:
    """The first schema violation as a 400; `param` is the top-level body field."""
    if not errors:
        return bad_request("invalid request body")
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {err.get('msg', '')}")
    if not loc:
        return bad_request(f"the body must be a JSON object: {err.get('msg', '')}")
    path = ".".join(str(p) for p in loc if not _is_union_tag(p))
    msg = err.get("msg", "invalid value")
    if any(_is_union_tag(p) for p in loc):
        msg = f"matches none of the accepted forms (e.g. {msg.lower()})"
    return bad_request(f"{path}: {msg}", param=str(loc[0]))


def _is_union_tag(part: object) -> bool:
    """pydantic puts the union member it tried into `loc` ('list[int]', 'constrained-str')."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_NAMES)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    async def _known(_: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()

    for cls in KNOWN:  # handled inside the middleware stack, so they are counted
        app.add_exception_handler(cls, _known)
    app.add_exception_handler(Exception, _known)  # a bug: a bare 500


KNOWN = (APIError, RequestError, RequestRejected, SamplingParamsError, EngineOverloaded,
         EngineUnavailable, WorkerLost)


class BodyLimit:
    """ASGI middleware: read the whole request body up front, answering 413 past `max_bytes`
    (at once when Content-Length says so, else as soon as the count passes it)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._too_large(scope, send)
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(scope, send)
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _too_large(self, scope: Scope, send: Send) -> None:
        error = APIError(413, f"the request body is larger than {self.max_bytes} bytes",
                         code="request_too_large")
        await error.response()(scope, _no_body, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """Hand the buffered body to the app once; later calls wait for the disconnect."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}
