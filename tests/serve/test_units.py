"""Exact-value tests of the serving pieces, without processes: prices, keys, error mapping,
the wire codec, output streams, and the worker loop driven over an in-process socket pair."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from kiln.assembly import build_engine_core
from kiln.cluster.engine_client import OutputStream
from kiln.cluster.messages import (
    AbortRequests,
    AddRequests,
    Codec,
    Shutdown,
    StepOutputs,
    WorkerStats,
    parse_identity,
    worker_identity,
)
from kiln.cluster.worker import Worker
from kiln.config import EngineConfig, ModelConfig, ServeConfig, WorkerConfig
from kiln.engine.contract import EngineCoreOutput
from kiln.engine.core import EngineRequest
from kiln.engine.output_processor import RequestState, fan_out
from kiln.sampling_params import SamplingParams
from kiln.serve.auth import KeyStore
from kiln.serve.errors import from_validation_errors
from kiln.serve.usage import (
    DEFAULT_PRICING,
    Pricing,
    TokenCounts,
    load_price_table,
    pricing_for,
)


def test_cost_formula():
    p = Pricing(input=2.0, cached_input=0.5, output=10.0)
    assert p.cost(TokenCounts(prompt=1000, cached=400, completion=100)) == pytest.approx(
        (600 * 2.0 + 400 * 0.5 + 100 * 10.0) / 1e6)
    assert Pricing(input=1.0, output=1.0).cost(TokenCounts(10, 10, 0)) == pytest.approx(1e-5)


def test_price_tables_from_json_and_toml(tmp_path):
    (tmp_path / "p.json").write_text('{"a": {"input": 1, "output": 2}, "*": {"input": 3, '
                                     '"output": 4, "cached_input": 0}}')
    (tmp_path / "p.toml").write_text('[a]\ninput = 1.5\noutput = 2.5\n')
    table = load_price_table(tmp_path / "p.json")
    assert pricing_for(table, "a") == Pricing(input=1, output=2)
    assert pricing_for(table, "other").cached_input == 0
    assert pricing_for(load_price_table(tmp_path / "p.toml"), "a").input == 1.5
    assert pricing_for(None, "anything") == DEFAULT_PRICING
    with pytest.raises(ValueError, match="no entry"):
        pricing_for(load_price_table(tmp_path / "p.toml"), "b")


@pytest.mark.parametrize("text", ['{"a": {"input": -1, "output": 1}}',
                                  '{"a": {"input": 1}}', '{"a": {"input": 1, "output": 1, '
                                  '"surprise": 2}}', "not json"])
def test_bad_price_tables_name_the_file(tmp_path, text):
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(ValueError, match="bad.json"):
        load_price_table(tmp_path / "bad.json")


def test_key_store_matches_exactly():
    keys = KeyStore(("alpha", "beta"))
    assert keys.enabled and keys.check("alpha") and keys.check("beta")
    assert not keys.check("alph") and not keys.check("ALPHA") and not keys.check("")
    assert not KeyStore(()).enabled


def test_serve_config_validates():
    with pytest.raises(ValueError, match="max_top_logprobs"):
        ServeConfig(max_top_logprobs=21)
    with pytest.raises(ValueError, match="API keys"):
        ServeConfig(api_keys=("",))
    with pytest.raises(ValueError, match="worker_id"):
        WorkerConfig(worker_id="a.b")


def test_validation_errors_name_the_top_level_field():
    err = from_validation_errors([{"loc": ("body", "prompt", "list[int]", 0),
                                   "msg": "Input should be a valid integer", "type": "x"}])
    assert err.status == 400 and err.param == "prompt"
    assert "list[int]" not in err.message
    assert from_validation_errors([{"loc": ("body", 7), "msg": "bad", "type": "json_invalid"}
                                   ]).param is None


def test_wire_codec_round_trip_and_rejects_strangers():
    codec = Codec()
    add = AddRequests([EngineRequest(request_id="r", prompt_token_ids=[1, 2],
                                     params=SamplingParams(stop=["x"], seed=3))])
    assert codec.decode_gateway_message(codec.encode(add)) == add
    for message in (AbortRequests(["r"]), Shutdown()):
        assert codec.decode_gateway_message(codec.encode(message)) == message
    step = StepOutputs([EngineCoreOutput("r", [5], finish_reason="stop")],
                       WorkerStats(num_steps=2))
    assert codec.decode_worker_message(codec.encode(step)) == step
    with pytest.raises(msgspec.MsgspecError):
        codec.decode_gateway_message(codec.encode(step))  # a worker message is not a command
    with pytest.raises(msgspec.MsgspecError):
        codec.decode_worker_message(b"\x93\x01\x02")
    assert parse_identity(worker_identity("worker-0", 4)) == ("worker-0", 4)
    assert parse_identity(b"garbage") is None


def test_fan_out_seeds_children_apart():
    children = fan_out("r", [1, 2], SamplingParams(n=3, seed=10))
    assert [c.request_id for c in children] == ["r_0", "r_1", "r_2"]
    assert [c.params.seed for c in children] == [10, 11, 12]
    assert all(c.params.n == 1 for c in children)
    assert [c.request_id for c in fan_out("r", [1], SamplingParams())] == ["r"]


def test_request_state_stops_on_a_stop_string(llama_path):
    from kiln.llm import load_tokenizer

    tok = load_tokenizer(llama_path)
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    state = RequestState.create("r", [1], SamplingParams(stop=["brown"]), tok)
    abort = [state.absorb(EngineCoreOutput("r", [t])) for t in ids]
    seq = state.sequences["r"]
    assert seq.finish_reason == "stop" and seq.stop_reason == "brown"
    assert seq.text == "The quick " and True in abort
    delta = seq.take_delta()
    assert delta.text == "The quick " and delta.finish_reason == "stop"


def test_output_stream_batches_and_ends():
    async def scenario():
        aborted = []
        stream = OutputStream(["a", "b"], aborted.extend)
        stream.deliver(EngineCoreOutput("a", [1]))
        stream.deliver(EngineCoreOutput("a", [2], finish_reason="length"))
        first = await stream.__anext__()
        stream.abort(["b"])
        rest = [batch async for batch in stream]
        return first, rest, aborted

    first, rest, aborted = asyncio.run(scenario())
    assert [o.new_token_ids for o in first] == [[1], [2]]
    assert rest == [] and aborted == ["b"]


@pytest.fixture(scope="module")
def engine(llama_path):
    return build_engine_core(EngineConfig(model=ModelConfig(model=llama_path, dtype="float32")))


def test_worker_loop_over_a_socket_pair(engine):
    """The worker's protocol without a process: ready first, a rejection for the empty
    prompt, outputs step by step, heartbeats, and exit on Shutdown."""
    ctx = zmq.Context()
    gateway, worker_sock = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    gateway.bind("inproc://worker-test")
    worker_sock.connect("inproc://worker-test")
    codec = Codec()
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    gateway.send(codec.encode(AddRequests([
        EngineRequest(request_id="a", prompt_token_ids=[5, 6, 7], params=params),
        EngineRequest(request_id="bad", prompt_token_ids=[], params=params)])))
    gateway.send(codec.encode(AbortRequests(["nobody"])))
    worker = Worker(WorkerConfig(heartbeat_interval_s=0.05), engine, worker_sock)
    thread = threading.Thread(target=worker.run, args=(0,))
    thread.start()
    kinds, tokens = [], []
    while not tokens or len(tokens) < 5:
        message = codec.decode_worker_message(gateway.recv())
        kinds.append(type(message).__name__)
        if isinstance(message, StepOutputs):
            tokens += [t for o in message.outputs for t in o.new_token_ids]
    time.sleep(0.1)  # idle: heartbeats only
    gateway.send(codec.encode(Shutdown()))
    thread.join(10)
    while gateway.poll(0):
        kinds.append(type(codec.decode_worker_message(gateway.recv())).__name__)
    ctx.destroy(linger=0)
    assert kinds[0] == "WorkerReady" and "Rejected" in kinds and "Heartbeat" in kinds
    assert len(tokens) == 5 and not thread.is_alive()
    assert not engine.has_unfinished()
