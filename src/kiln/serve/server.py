"""`kiln serve` as processes: this (gateway) process runs uvicorn and supervises its spawned
engine workers (one by default; `--workers N` or `--prefill-workers P --decode-workers D`)
through a `ClusterClient` (kiln.cluster.cluster_client), which also admits workers that join over TCP.

CPU: the worker owns the engine's torch threads (`--threads`, default all cores); its OpenMP
threads keep the default wait policy (spin briefly between ops, then sleep), so the gateway's
single event-loop thread gets the CPU while the worker waits; the gateway's per-token work is
one detokenizer step and one SSE write per stream per engine step.

Shutdown: the first SIGTERM/SIGINT stops admission (new requests and /health get 503), waits
up to `shutdown_timeout_s` for open requests to finish, fails the rest (streams get an error
event, then [DONE]), stops the worker and exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import uvicorn

from kiln.cluster.launch import build_cluster_client
from kiln.config import ServeConfig, WorkerConfig
from kiln.engine.core import resolve_model_path
from kiln.serve.app import build_app
from kiln.serve.context import ServeContext
from kiln.serve.frontend import Frontend
from kiln.serve.metrics import ServeMetrics
from kiln.serve.usage import load_price_table, pricing_for

log = logging.getLogger("kiln.serve")


def build_context(config: ServeConfig, worker: WorkerConfig) -> ServeContext:
    """Resolve the model, load the tokenizer and prices, and make (not start) the client."""
    from kiln.models.loader import read_hf_config

    model_path = resolve_model_path(worker.engine.model.model)
    read_hf_config(model_path)  # a missing or broken checkpoint fails here, in one line
    name = config.served_model_name or Path(model_path).name
    table = load_price_table(config.pricing_file) if config.pricing_file else None
    engine = worker.engine.replace(model=replace(worker.engine.model, model=model_path))
    client = build_cluster_client(config, replace(worker, engine=engine))
    return ServeContext(config=config, model_name=name, frontend=Frontend.load(model_path),
                        client=client, metrics=ServeMetrics(client),
                        pricing=pricing_for(table, name),
                        structured_config=worker.engine.structured)


class GatewayServer(uvicorn.Server):
    """uvicorn with kiln's signal handling (drain, then exit 0) and a fatal-worker exit."""

    def __init__(self, config: uvicorn.Config, ctx: ServeContext):
        super().__init__(config)
        self.ctx = ctx
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        self._loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._on_signal) for s in sigs}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, sig: int, _frame) -> None:
        if self._drain is not None:
            self.should_exit = self.force_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        ctx, timeout = self.ctx, self.ctx.config.shutdown_timeout_s
        ctx.draining = True
        log.info("draining: %d open requests, up to %g s", ctx.client.num_open, timeout)
        deadline = time.monotonic() + timeout
        while ctx.client.num_open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if ctx.client.num_open:
            log.warning("aborting %d requests still open", ctx.client.num_open)
            ctx.client.fail_all("the server is shutting down")
            await asyncio.sleep(0.1)  # let their handlers write the errors
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        fatal = self.ctx.client.fatal_error
        if fatal:
            log.error("%s", fatal)
            self.exit_code = 1
            return True
        return await super().on_tick(counter)


def serve(config: ServeConfig, worker: WorkerConfig) -> int:
    """Run the gateway and its worker until shutdown; the process exit status."""
    ctx = build_context(config, worker)
    uv_config = uvicorn.Config(build_app(ctx), host=config.host, port=config.port,
                               log_level="info", access_log=config.access_log,
                               timeout_graceful_shutdown=5,
                               timeout_keep_alive=5)
    server = GatewayServer(uv_config, ctx)
    server.run()
    return server.exit_code
