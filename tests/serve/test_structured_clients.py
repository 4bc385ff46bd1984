"""Issue 51: the official openai SDK's typed helpers work unchanged against `kiln serve` (the
tiny random model, the server's default repetition guard): `chat.completions.parse` with a
Pydantic `response_format`, `chat.completions.stream` with one, and strict function tools
(`openai.pydantic_function_tool`). The SDK itself parses and validates, and rejects any
finish_reason outside OpenAI's values, so these pass only if kiln's wire format is OpenAI's."""

from __future__ import annotations

import enum
import os

import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import MODEL

MSG = [{"role": "user", "content": "Describe a city as JSON."}]


class Kind(str, enum.Enum):
    capital = "capital"
    town = "town"


class City(BaseModel):
    name: str
    country: str
    population_millions: float
    kind: Kind


class Item(BaseModel):
    name: str
    quantity: int


class Order(BaseModel):
    order_id: str
    items: list[Item]
    note: str | None


@pytest.mark.parametrize("model", [City, Order])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_a_validated_model(client, model, temperature):
    out = client.chat.completions.parse(model=MODEL, messages=MSG, max_tokens=400,
                                        temperature=temperature, seed=1, response_format=model)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)


def test_stream_with_response_format_parses(client):
    with client.chat.completions.stream(model=MODEL, messages=MSG, max_tokens=400,
                                        temperature=0, response_format=City) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"
    assert isinstance(final.choices[0].message.parsed, City)


class GetWeather(BaseModel):
    city: str = Field(max_length=8)  # the random model's strings run long: keep calls short
    days: int = Field(ge=1, le=7)


def test_strict_function_tools_parse(client):
    out = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=400, temperature=0, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    """LangChain's `with_structured_output` (an optional test dependency: langchain-openai)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1",
                                      api_key="unused", temperature=0, max_tokens=400,
                                      max_retries=0)
    schema = City if method == "json_schema" else GetWeather
    structured = llm.with_structured_output(schema, method=method, strict=True)
    assert isinstance(structured.invoke("Describe it as JSON."), schema)


def test_litellm_completion_with_a_pydantic_response_format(server):
    """LiteLLM's OpenAI-compatible provider (an optional test dependency: litellm) sends the
    Pydantic model as a strict json_schema; the content it returns validates against it."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    litellm = pytest.importorskip("litellm")
    out = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server.base_url}/v1",
                             api_key="unused", messages=MSG, max_tokens=400, temperature=0,
                             response_format=City, num_retries=0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert City.model_validate_json(choice.message.content).name
