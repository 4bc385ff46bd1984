"""Issue 51: the offline API shows the JSON closing budget too. A checkpoint that loves to
continue a list item (tests/engine/test_structured_limits.py) is steered to close its JSON
within max_tokens: `RequestOutput.metrics["json_closing_steered"]` counts the narrowed draws
(kept tokens only); requests the budget never touched have no such entry."""

from __future__ import annotations

import json

import pytest

from kiln import LLM, SamplingParams
from kiln.sampling_params import StructuredOutputsParams
from tests.engine.test_structured_limits import CLOSING, make_loving_checkpoint

SHORT = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_loving_checkpoint(tmp_path_factory.mktemp("loving-report"), '",')
    return LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, num_threads=1)


def _generate(llm, max_tokens, schema=None):
    structured = StructuredOutputsParams(json=schema) if schema is not None else None
    return llm.generate("Data:", SamplingParams(max_tokens=max_tokens, temperature=0,
                                                structured_outputs=structured),
                        use_tqdm=False)[0]


def test_the_offline_output_counts_the_steered_tokens(llm):
    before = llm.engine.structured.num_closings
    out = _generate(llm, 40, CLOSING["items"])
    tokens = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "stop" and len(tokens) <= 40
    json.loads(out.outputs[0].text)
    assert 0 < out.metrics["json_closing_steered"] <= len(tokens)
    assert llm.engine.structured.num_closings == before + 1


def test_untouched_outputs_have_no_count(llm):
    early = _generate(llm, 200, SHORT)
    assert early.outputs[0].finish_reason == "stop"
    assert "json_closing_steered" not in early.metrics
    assert "json_closing_steered" not in _generate(llm, 16).metrics
