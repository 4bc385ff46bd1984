"""Schemathesis over the app's own OpenAPI schema: no input produces a 5xx, every response is
documented and matches its schema. In-process with a fake engine (fast, positive and negative
cases, NUL bytes allowed), plus a short run against the real server."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from kiln.config import ServeConfig
from kiln.serve.app import build_app
from kiln.serve.context import ServeContext
from kiln.serve.frontend import Frontend
from kiln.serve.metrics import ServeMetrics
from kiln.serve.usage import DEFAULT_PRICING
from tests.serve.fake_engine import FakeEngineClient

# positive cases may still be refused on purpose (a random `model` is a 404, a random prompt
# can overflow the context): "no 5xx, documented status, valid body" is the contract here
EXCLUDED = [positive_data_acceptance]


@pytest.fixture(scope="module")
def fake_app(llama_path):
    frontend = Frontend.load(llama_path)
    client = FakeEngineClient(frontend.vocab_size)
    ctx = ServeContext(config=ServeConfig(max_body_bytes=1 << 20), model_name="fake",
                       frontend=frontend, client=client, metrics=ServeMetrics(client),
                       pricing=DEFAULT_PRICING)
    return build_app(ctx)


def fuzz(schema, modes: list[GenerationMode], examples: int, **call_kwargs) -> int:
    """Run `examples` cases per operation and mode; the number of operations covered.
    (Plain hypothesis over schemathesis strategies: its pytest plugin predates pytest 9.)"""
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        for mode in modes:
            if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                continue  # our GET routes take no input: nothing can be made invalid
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                case.call_and_validate(excluded_checks=EXCLUDED, **call_kwargs)

            run()
    return len(operations)


def test_in_process_app_never_fails(fake_app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", fake_app)
    schema.config.generation.update(allow_x00=True)
    assert fuzz(schema, list(GenerationMode), examples=40) == 8  # incl. /debug/route


def test_live_server_never_fails(server):
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    schema.config.generation.update(allow_x00=True)
    assert fuzz(schema, list(GenerationMode), examples=6, timeout=60) == 8
