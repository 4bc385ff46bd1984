"""The HTTP routes (FastAPI). Handlers live in chat.py / completions.py; this file wires them.

Middleware, outermost first: error counting (every status >= 400), API keys (before the body
is read), the body-size limit (413). The app's lifespan starts and closes the engine client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kiln.serve.auth import APIKeyAuth, KeyStore, tenant_salt
from kiln.serve.chat import create_chat_completion
from kiln.serve.completions import create_completion
from kiln.serve.context import ServeContext
from kiln.serve.errors import APIError, BodyLimit, bad_request, install_handlers
from kiln.serve.metrics import ErrorCounter
from kiln.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kiln.version import __version__

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}
SSE = {200: {"content": {"text/event-stream": {}}}}


def build_app(ctx: ServeContext) -> FastAPI:
    app = FastAPI(title="kiln", version=__version__, lifespan=_lifespan(ctx),
                  description="An OpenAI-compatible LLM inference server.")
    install_handlers(app)
    _add_routes(app, ctx)
    app.openapi = _openapi_without_422(app)
    app.add_middleware(BodyLimit, max_bytes=ctx.config.max_body_bytes)
    app.add_middleware(APIKeyAuth, keys=KeyStore(ctx.config.api_keys))
    app.add_middleware(ErrorCounter, metrics=ctx.metrics)
    return app


def _openapi_without_422(app: FastAPI):
    """FastAPI documents a 422 for every body; kiln answers schema errors with 400."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
        return app.openapi_schema

    return openapi


def _lifespan(ctx: ServeContext):
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await ctx.client.start()
        try:
            yield
        finally:
            await ctx.client.close()

    return lifespan


def _add_routes(app: FastAPI, ctx: ServeContext) -> None:
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**ERRORS, **SSE})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, ctx, request)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**ERRORS, **SSE})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, ctx, request)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> ModelList:
        limits = ctx.client.limits
        return ModelList(data=[ModelCard(id=ctx.model_name, created=ctx.created,
                                         max_model_len=limits.max_model_len if limits else None)])

    @app.get("/health", response_model=HealthResponse, responses=ERRORS)
    async def health() -> Response:
        try:
            ctx.check_available()
        except APIError as exc:
            return exc.response()
        return JSONResponse(HealthResponse().model_dump())

    @app.get("/metrics", responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, **ERRORS})
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    _add_tokenizer_routes(app, ctx)
    _add_debug_routes(app, ctx)


def _add_debug_routes(app: FastAPI, ctx: ServeContext) -> None:
    @app.post("/debug/route", responses=ERRORS)
    async def explain_route(body: TokenizeRequest, request: Request) -> Response:
        """Which worker a prompt would go to now, with every worker's score (kiln.cluster
        router), for the caller's tenant; nothing is routed or charged."""
        ctx.check_model(body.model)
        explain = getattr(ctx.client, "explain", None)
        if explain is None:
            raise APIError(404, "this engine client does not route", code="not_found")
        tokens = prompt_tokens(ctx, body)
        return JSONResponse(dataclasses.asdict(explain(tokens, tenant_salt(request))))


def prompt_tokens(ctx: ServeContext, body) -> list[int]:
    """The token ids of a body holding exactly one of `prompt` (text) or `messages` (chat)."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        return ctx.frontend.chat_prompt(body.messages, body.add_generation_prompt)
    return ctx.frontend.encode(body.prompt, body.add_special_tokens)


def _add_tokenizer_routes(app: FastAPI, ctx: ServeContext) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        tokens = prompt_tokens(ctx, body)
        limits = ctx.client.limits
        return TokenizeResponse(count=len(tokens), tokens=tokens,
                                max_model_len=limits.max_model_len if limits else None)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        return DetokenizeResponse(prompt=ctx.frontend.decode(body.tokens))
