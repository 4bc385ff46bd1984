"""The gateway's handle on its engine workers: submit, stream outputs, abort, health.

`EngineClient` is the whole interface the HTTP layer uses; `ClusterClient`
(cluster_client.py) implements it over one or many workers, spawned or joined over the network.

Lifecycle: `start()` binds the sockets and spawns the workers; the client is `ready` while at
least one worker is registered and reporting. `submit()` returns an `OutputStream` per group
of engine requests (one prompt's n children, or several prompts); iterate it for batches of
outputs; `close()` it when done (it aborts whatever is unfinished). A request whose worker is
lost is retried or migrated to another worker, or its stream fails with `WorkerLost`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Protocol

from kiln.cluster.messages import WorkerStats
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.core import EngineRequest
from kiln.engine.limits import EngineLimits


class EngineUnavailable(Exception):
    """No worker can take requests now (starting, restarting, down): HTTP 503."""


class EngineOverloaded(Exception):
    """The bounded admission queue is full: HTTP 429."""


class WorkerLost(Exception):
    """The worker running a request died or stopped responding, and the request could not be
    resumed elsewhere; it is lost."""


class RequestRejected(Exception):
    """The engine refused a request (it failed the engine's own validation)."""

    def __init__(self, message: str, param: str | None, code: str | None):
        super().__init__(message)
        self.param, self.code = param, code


class OutputStream:
    """Outputs of one submitted group of engine requests, batched as they arrive.

    `async for batch in stream` yields every output that arrived since the previous batch
    (at least one), ends once every request of the group finished in the engine, and raises
    `WorkerLost` / `RequestRejected` after the outputs that came before the failure.
    """

    def __init__(self, request_ids: list[str], abort: Callable[[list[str]], None]):
        self.request_ids = request_ids
        self.open = set(request_ids)  # not yet finished in the engine
        self._abort = abort
        self._buffer: list[EngineCoreOutput] = []
        self._error: Exception | None = None
        self._wake = asyncio.Event()

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> list[EngineCoreOutput]:
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if not self.open:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()
        batch, self._buffer = self._buffer, []
        return batch

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Abort some (default: all) of this group's still-open requests in the engine; they
        count as finished here at once (the engine's echo of the abort is not delivered)."""
        ids = [r for r in (self.open if request_ids is None else request_ids) if r in self.open]
        if ids:
            self._abort(ids)
            self.open.difference_update(ids)
            self._wake.set()

    def close(self) -> None:
        """Abort what is still open and stop receiving (idempotent; call when done)."""
        self.abort()
        self.open.clear()
        self._wake.set()

    def deliver(self, out: EngineCoreOutput) -> None:
        if out.request_id not in self.open:
            return
        self._buffer.append(out)
        if out.finished:
            self.open.discard(out.request_id)
        self._wake.set()

    def fail(self, error: Exception) -> None:
        self._error = error
        self.open.clear()
        self._wake.set()


class EngineClient(Protocol):
    """What the HTTP layer needs from the engine side (one worker or a routed cluster)."""

    @property
    def ready(self) -> bool:
        """True while some worker is loaded, alive and reporting (it steps when it has work)."""

    @property
    def limits(self) -> EngineLimits | None:
        """The limits requests are validated against; None until the first worker is ready."""

    @property
    def capacity(self) -> int:
        """Most engine requests that may be open at once (running + admission queue)."""

    @property
    def stats(self) -> WorkerStats:
        """Engine stats from the latest step or heartbeat (summed over workers)."""

    @property
    def fatal_error(self) -> str | None:
        """Set when the engine can never come up (e.g. the model fails to load)."""

    @property
    def num_open(self) -> int:
        """Engine requests submitted and not yet finished."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def submit(self, requests: list[EngineRequest]) -> OutputStream:
        """Send the requests; raise EngineUnavailable or EngineOverloaded (nothing is sent)."""

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests in the engine; unknown or finished ids are ignored."""

    def fail_all(self, reason: str) -> None:
        """Abort every open request and fail its stream with WorkerLost(reason)."""
