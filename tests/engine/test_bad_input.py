"""Every bad input gets one clear error naming the problem, never a deep torch traceback."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from kiln.engine.core import RequestError
from kiln.models.loader import CheckpointError
from kiln.sampling_params import SamplingParamsError


def test_empty_prompt(tiny_llm):
    with pytest.raises(RequestError, match="empty"):
        tiny_llm.generate([{"prompt_token_ids": []}])
    with pytest.raises(RequestError, match="empty"):
        tiny_llm.generate([""])


def test_prompt_longer_than_max_model_len(llama_path):
    llm = LLM(llama_path, dtype="float32", max_model_len=32, num_threads=1)
    with pytest.raises(RequestError, match="maximum context length is 32") as err:
        llm.generate([{"prompt_token_ids": list(range(5, 45))}])
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="30 in the prompt"):
        llm.generate([{"prompt_token_ids": list(range(5, 35))}], SamplingParams(max_tokens=10))


def test_token_id_outside_vocabulary(tiny_llm):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        tiny_llm.generate([{"prompt_token_ids": [1, 10**6]}])


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert param.split("_")[0] in str(err.value)


def test_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_model_path_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(str(tmp_path))


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_truncated_safetensors(tmp_path, llama_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(llama_path, bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        LLM(str(bad), dtype="float32")


def test_missing_tensor_is_named(tmp_path, llama_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "missing"
    shutil.copytree(llama_path, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="down_proj"):
        LLM(str(bad), dtype="float32")


def test_failed_batch_adds_nothing(tiny_llm):
    with pytest.raises(RequestError):
        tiny_llm.generate(["fine", {"prompt_token_ids": []}])
    assert not tiny_llm.engine.has_unfinished()
