"""Issue 51: the finish reasons on the wire are OpenAI's; a repetition-guard stop shows as
finish_reason "stop" with stop_reason "repetition" (vLLM's field); other stop reasons pass."""

from __future__ import annotations

import pytest

from kiln.serve.generation import openai_finish_reason, openai_stop_reason


@pytest.mark.parametrize("engine, stop_reason, wire", [
    ("stop", None, ("stop", None)),
    ("stop", "</s>", ("stop", "</s>")),
    ("stop", 7, ("stop", 7)),
    ("length", None, ("length", None)),
    ("repetition", None, ("stop", "repetition")),
    (None, None, (None, None)),
])
def test_engine_reasons_map_to_openai_values(engine, stop_reason, wire):
    assert (openai_finish_reason(engine), openai_stop_reason(engine, stop_reason)) == wire
