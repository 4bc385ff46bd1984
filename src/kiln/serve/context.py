"""What every request handler shares: one `ServeContext` per server (passed, never global)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from kiln.cluster.engine_client import EngineClient
from kiln.config import ServeConfig, StructuredConfig
from kiln.serve.errors import APIError
from kiln.serve.frontend import Frontend
from kiln.serve.metrics import ServeMetrics
from kiln.serve.usage import Pricing
from kiln.structured.gateway import GatewayStructured


@dataclass
class ServeContext:
    """Shared state of one server. Only `draining` changes after construction (SIGTERM)."""

    config: ServeConfig
    model_name: str  # what clients send as `model`
    frontend: Frontend
    client: EngineClient
    metrics: ServeMetrics
    pricing: Pricing
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    # grammar checks before admission (kiln.structured); the workers' compile limits
    structured_config: StructuredConfig = field(default_factory=StructuredConfig)
    structured: GatewayStructured = field(init=False)

    def __post_init__(self):
        self.structured = GatewayStructured(
            self.structured_config, self.frontend.tokenizer,
            on_compile=lambda _spec, seconds: self.metrics.grammar_compile.observe(seconds))

    def check_model(self, model: str | None) -> None:
        """404 `model_not_found` unless `model` is absent or the served name."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist", param="model",
                           code="model_not_found")

    def check_available(self) -> None:
        """503 while draining for shutdown or while no worker is ready."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if self.client.fatal_error:
            raise APIError(503, self.client.fatal_error, code="engine_unavailable")
        if not self.client.ready or self.client.limits is None:
            raise APIError(503, "the engine worker is not ready (starting or restarting)",
                           code="engine_unavailable", headers={"Retry-After": "5"})


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
