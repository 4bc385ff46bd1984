"""The config dataclasses as one source: `Literal` choices checked in one place, and
`LLM(**settings)` mapped onto the configs' fields by name, an unknown one named with the
closest."""

from __future__ import annotations

import pytest

import kiln.llm
from kiln import LLM
from kiln.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
    StructuredConfig,
    WorkerConfig,
    engine_config_from,
    setting_sections,
)


class Built(Exception):
    """Raised in place of building the engine: the test has the config it wanted."""


@pytest.fixture
def built_config(monkeypatch):
    """LLM(...) -> the EngineConfig it would build its engine from (no model is loaded)."""
    def capture(config: EngineConfig):
        raise Built(config)

    monkeypatch.setattr(kiln.llm, "build_engine_core", capture)

    def build(*args, **kwargs) -> EngineConfig:
        with pytest.raises(Built) as built:
            LLM(*args, **kwargs)
        return built.value.args[0]

    return build


def test_llm_keywords_the_readme_lists_map_onto_the_configs(built_config):
    config = built_config(
        "m", dtype="float32", max_model_len=256, kv_cache_memory=1 << 20,
        enable_prefix_caching=False, block_size=32, max_num_seqs=4, max_num_batched_tokens=64,
        enable_chunked_prefill=False, scheduling_policy="priority", quantization="int8", seed=3,
        num_threads=2, kernels="torch", linear_backend="torch", speculator="ngram",
        repetition_guard="off")
    assert config.model == ModelConfig(model="m", dtype="float32", max_model_len=256, seed=3,
                                       quantization="int8", kernels="torch",
                                       linear_backend="torch")
    assert config.cache == CacheConfig(block_size=32, kv_cache_memory=1 << 20,
                                       enable_prefix_caching=False)
    assert config.scheduler == SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                               enable_chunked_prefill=False, policy="priority")
    assert config.parallel == ParallelConfig(num_threads=2)
    assert config.structured == StructuredConfig(repetition_guard="off")
    assert config.speculative.method == "ngram"
    assert built_config() == EngineConfig()
    assert built_config(speculative_config={"method": "ngram"}).speculative.method == "ngram"


def test_an_unknown_llm_keyword_is_a_type_error_naming_the_closest():
    with pytest.raises(TypeError, match="'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM(max_num_seq=4)
    with pytest.raises(TypeError, match="'speculater'; did you mean 'speculator'"):
        LLM(speculater="ngram")
    with pytest.raises(TypeError, match="unknown engine setting 'colour'$"):
        LLM(colour="blue")
    with pytest.raises(TypeError, match="same setting"):
        LLM(scheduling_policy="priority", policy="fcfs")


def test_settings_name_one_field_each():
    sections = setting_sections()
    assert sections["block_size"] == "cache" and sections["repetition_guard"] == "structured"
    assert engine_config_from({"compile_timeout_s": 2.0}).structured.compile_timeout_s == 2.0


@pytest.mark.parametrize("build, message", [
    (lambda: ModelConfig(dtype="bf16"), "dtype must be one of auto, bfloat16, float16, float32"),
    (lambda: ModelConfig(kernels="gpu"), "kernels must be one of auto, torch, cpp"),
    (lambda: ModelConfig(linear_backend="mkl"), "linear_backend must be one of"),
    (lambda: SchedulerConfig(policy="lifo"), "policy must be one of fcfs, priority"),
    (lambda: WorkerConfig(role="both-ways"), "role must be one of both, prefill, decode"),
    (lambda: ServeConfig(tool_call_parser="xml"), "tool_call_parser must be one of"),
    (lambda: StructuredConfig(repetition_guard="warn"), "repetition_guard must be one of"),
])
def test_a_value_outside_its_literal_is_refused_at_construction(build, message):
    with pytest.raises(ValueError, match=message):
        build()
