"""The OpenAI API over a real `kiln serve` with the official `openai` SDK: chat and
completions, streamed and not, usage and cost, n > 1, stop strings, seeds, logprobs, echo."""

from __future__ import annotations

import pytest

from kiln import SamplingParams
from kiln.serve.usage import DEFAULT_PRICING, TokenCounts
from tests.serve.conftest import MODEL

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 1024


def test_chat_completion(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                         **GREEDY)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.message.content
    u = out.usage
    assert u.completion_tokens == 12 and u.total_tokens == u.prompt_tokens + 12
    assert u.prompt_tokens_details.cached_tokens == 0 or u.prompt_tokens_details.cached_tokens
    expected = DEFAULT_PRICING.cost(TokenCounts(u.prompt_tokens,
                                                u.prompt_tokens_details.cached_tokens, 12))
    assert u.model_extra["cost"] == pytest.approx(expected)


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                          **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.model_extra["cost"] > 0


def test_completions_accept_every_prompt_form(client, server):
    tok = server.http().post("/tokenize", json={"prompt": "The quick brown"}).json()["tokens"]
    one = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=5,
                                    **GREEDY)
    many = client.completions.create(model=MODEL, prompt=["The quick brown", "Paris is"],
                                     max_tokens=5, **GREEDY)
    ids = client.completions.create(model=MODEL, prompt=tok, max_tokens=5, **GREEDY)
    id_lists = client.completions.create(model=MODEL, prompt=[tok, tok], max_tokens=5, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == one.choices[0].text == ids.choices[0].text
    assert [c.text for c in id_lists.choices] == [one.choices[0].text] * 2
    assert many.usage.prompt_tokens == len(tok) + len(server.http().post(
        "/tokenize", json={"prompt": "Paris is"}).json()["tokens"])


def test_completion_stream(client):
    full = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=30, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="Paris is", max_tokens=30,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_greedy_matches_the_offline_llm(client, tiny_llm):
    offline = tiny_llm.generate(["def add(a, b):"], SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    served = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=20,
                                       **GREEDY)
    assert served.choices[0].text == offline.text


def test_n_choices_share_one_prompt_bill(client):
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", n=3, max_tokens=8,
                                    temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 24
    single = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=1)
    assert out.usage.prompt_tokens == single.usage.prompt_tokens


def test_n_choices_stream(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, max_tokens=6, temperature=1.0, seed=3, stream=True,
        extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL, prompt="The", max_tokens=30, **GREEDY)
    text = base.choices[0].text
    stop = text[8:11]
    assert stop and text.find(stop) >= 0
    cut = client.completions.create(model=MODEL, prompt="The", max_tokens=30, stop=[stop],
                                    **GREEDY)
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(model=MODEL, prompt="The", max_tokens=30,
                                              stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == text[:text.find(stop)]


def test_seed_reproduces_a_sampled_output(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                              temperature=1.0, seed=seed,
                                              extra_body={"ignore_eos": True})
    a, b, c = sample(1234), sample(1234), sample(99)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                         logprobs=True, top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy = top 1


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=4, logprobs=2,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_max_tokens_zero_gives_prompt_logprobs(client, tiny_llm):
    """lm-evaluation-harness local-completions log-likelihood requests."""
    prompt = "The quick brown fox jumps over the lazy dog"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == out.usage.prompt_tokens
    ref = tiny_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    ids = ref.prompt_token_ids
    expected = [ref.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_echo_with_generation(client):
    out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=3, echo=True,
                                    logprobs=0, **GREEDY)
    choice = out.choices[0]
    assert choice.text.startswith("Paris is") and len(choice.text) > len("Paris is")
    assert len(choice.logprobs.tokens) == out.usage.prompt_tokens + 3


def test_prefix_cache_hit_is_reported_and_cheaper(client):
    prompt = "Large language models predict the next token. " * 8
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0
    assert second.usage.model_extra["cost"] < first.usage.model_extra["cost"]


def test_tokenize_and_detokenize(server):
    http = server.http()
    tokens = http.post("/tokenize", json={"prompt": "Paris is nice"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Paris is nice"
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tokens["count"]


def test_metrics_are_exposed(server, client):
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    names = {k.split("{")[0] for k in server.metrics()}
    for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens_total",
                 "generation_tokens_total", "prompt_tokens_cached_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "prefix_cache_hit_rate",
                 "kv_cache_blocks_used", "num_preemptions_total", "request_success_total",
                 "request_cost_usd_total", "worker_ready"):
        assert f"kiln:{name}" in names, name
    assert 'kiln:cpu_info{isa="' in server.http().get("/metrics").text  # labels hold spaces
