"""``expertcache serve``: the official openai client against a tiny model served on 127.0.0.1.

The model and its chat tokenizer are built in the test; the server binds a free port and
is always stopped. Greedy answers are compared with the uncached model's generate.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from tiny_chat import chat_tokenizer  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

import expertcache  # noqa: E402
from expertcache.serve import Server, ServeSettings  # noqa: E402
from expertcache.serve.server import is_loopback  # noqa: E402

NAME = "tiny-moe"
PROMPT = "w1 w2 w3 w4"
MESSAGES = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def reference():
    return tiny_model("mixtral")  # the same weights, not offloaded


def expected(reference, tokenizer, ids: list[int], n: int) -> tuple[str, list[int]]:
    """What the uncached model's greedy generate says."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def server(tokenizer):
    model = expertcache.offload(tiny_model("mixtral"), slots=5, eviction="slru",
                                eviction_params={"protected": 0.5})
    srv = Server(model, tokenizer, ServeSettings(NAME, port=0, max_tokens=64, max_body_bytes=4096))
    srv.start()
    yield srv, model
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", timeout=30, max_retries=0) as c:
        yield c


def test_completion_streamed_and_not_equal_generate(client, reference, tokenizer):
    text, new = expected(reference, tokenizer, tokenizer(PROMPT).input_ids, 12)
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 12, 16)
    parts = [c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == text and len([p for p in parts if p]) > 1  # it did stream


def test_chat_streamed_and_not_equal_generate(client, reference, tokenizer):
    text, new = expected(reference, tokenizer, chat_ids(tokenizer, MESSAGES), 10)
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 10  # 3 role markers + 4 words
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10 and "hit_rate" in chunks[-1].usage.expertcache


def test_models_and_usage_block(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=0)
    block = r.usage.expertcache
    assert block["policy"] == "slru:protected=0.5+always" and block["slots"] == 5
    assert 0 <= block["hit_rate"] <= 1 and block["h2d_bytes"] > 0
    assert block["decode_cold_tok_s"] > 0 and block["decode_steady_tok_s"] > 0  # 19 steps: 16 + 3


def test_stats_endpoint_equals_cache_stats(client, server):
    srv, model = server
    client.completions.create(model=NAME, prompt="w9 w8", max_tokens=5, temperature=0)
    body = httpx.get(srv.url + "/v1/expertcache/stats").json()
    stats = model.expertcache.stats()
    assert body["cache"]["stats"] == json.loads(json.dumps(stats.to_dict()))
    assert body["cache"]["hit_rate"] == stats.total().hit_rate
    assert body["cache"]["h2d_bytes"] == stats.h2d_bytes() > 0
    assert body["cache"]["slots"] == 5 and body["cache"]["policy"].startswith("slru:protected=0.5")
    assert body["requests"] >= 1 and body["last_request"]["hit_rate"] is not None
    assert body["since_start"]["cold"]["tokens"] > 0 and body["since_start"]["cold"]["tok_s"] > 0


def test_sampling_seed_repeats_and_stop_cuts(client):
    def ask(seed):
        return client.completions.create(model=NAME, prompt=PROMPT, max_tokens=15, temperature=1.0,
                                         top_p=0.9, seed=seed, extra_body={"top_k": 20}).choices[0].text
    assert ask(7) == ask(7)
    full = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stop = full.split()[3]
    cut = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:full.index(stop)]


@pytest.mark.parametrize("body, status, words", [
    ({"model": "other", "prompt": PROMPT}, 404, "not served here"),
    ({"model": NAME, "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": NAME, "prompt": PROMPT, "max_tokens": -3}, 400, "max_tokens"),
    ({"model": NAME, "prompt": PROMPT, "max_tokens": 65}, 400, "at most 64"),
    ({"model": NAME, "prompt": " ".join(["w3"] * 129)}, 400, "context of 128"),
    ({"model": NAME, "prompt": " ".join(["w3"] * 100), "max_tokens": 40}, 400, "exceed the model's context"),
    ({"model": NAME, "prompt": PROMPT, "temperature": 5}, 400, "temperature"),
    ({"model": NAME, "prompt": PROMPT, "n": 2}, 400, "n must be 1"),
    ({"model": NAME}, 400, "prompt"),
    ({"model": NAME, "prompt": "w1 " * 2000}, 413, "at most 4096"),
])
def test_bad_requests_get_openai_errors(server, body, status, words):
    r = httpx.post(server[0].url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_and_misrouted_requests(server, client):
    url = server[0].url
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "x"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    assert httpx.get(url + "/v1/completions", timeout=30).status_code == 405
    assert httpx.get(url + "/v1/nothing", timeout=30).json()["error"]["message"].endswith("Not Found")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0)
    # the server keeps serving
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0).choices[0].text


def test_api_key_required(tokenizer):
    model = expertcache.offload(tiny_model("mixtral"), slots=6)
    with Server(model, tokenizer, ServeSettings(NAME, port=0, api_key="s3cret")) as srv:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 401
        wrong = httpx.post(srv.url + "/v1/completions", json=body, timeout=30,
                           headers={"Authorization": "Bearer s3creT"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/expertcache/stats", timeout=30).status_code == 401
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0) as good:
            assert good.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_loopback_by_default_and_a_warning_beyond(tokenizer, capsys):
    assert ServeSettings(NAME).host == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example.org")
    model = expertcache.offload(tiny_model("mixtral"), slots=6)
    srv = Server(model, tokenizer, ServeSettings(NAME, host="0.0.0.0"))
    srv.warn_if_exposed()
    srv.service.worker.stop()
    assert "beyond this machine's loopback" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_tokens"):
        ServeSettings(NAME, max_tokens=0)


def test_a_client_leaving_a_plain_request_cancels_it(server):
    srv, _ = server
    before = httpx.get(srv.url + "/v1/expertcache/stats").json()["completion_tokens"]
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 64, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):  # leaves after 0.02 s, long before 64 tokens (~0.2 s)
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.02))
    deadline = time.monotonic() + 30
    while srv.service.worker.running is not None or srv.service.worker.jobs.qsize():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    made = httpx.get(srv.url + "/v1/expertcache/stats").json()["completion_tokens"] - before
    assert made < 64  # 0 when it was cancelled before it started


def test_a_chat_template_refusing_the_messages_is_a_400(server, tokenizer):
    srv, _ = server
    template = tokenizer.chat_template
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system "
                               "messages') }}{% endif %}" + template)
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={"model": NAME, "messages": MESSAGES, "max_tokens": 2})
    finally:
        tokenizer.chat_template = template
    assert r.status_code == 400 and "no system messages" in r.json()["error"]["message"]


# -- parameters this server does not implement, and the error fields (issue 17) --------------
CHAT = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
DONE = {"model": NAME, "prompt": PROMPT, "max_tokens": 2}


@pytest.mark.parametrize("route, extra, param", [
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logprobs": 2}, "logprobs"),
    ("chat", {"frobnicate": 1}, "frobnicate"),
    ("completions", {"messages": []}, "messages"),  # a chat field on the completions route
    ("chat", {"temperature": 5}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"stop": [""]}, "stop"),
    ("completions", {"max_tokens": 200}, "max_tokens"),
])
def test_unsupported_and_bad_parameters_are_named(server, route, extra, param):
    body = {**(CHAT if route == "chat" else DONE), **extra}
    r = httpx.post(f"{server[0].url}/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                   json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param in error["message"]


def test_parameters_that_ask_for_nothing_pass(server):
    """What many clients send by default is not a request for a feature."""
    neutral = {"logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "tools": [],
               "response_format": {"type": "text"}, "user": "someone", "logit_bias": {}}
    r = httpx.post(server[0].url + "/v1/chat/completions", json={**CHAT, **neutral}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(server[0].url + "/v1/completions", json={**DONE, "echo": False, "best_of": 1}, timeout=30)
    assert r.status_code == 200, r.text


def test_context_errors_name_the_prompt_field(server):
    long = " ".join(["w3"] * 129)
    r = httpx.post(server[0].url + "/v1/completions", json={"model": NAME, "prompt": long}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    chat = {"model": NAME, "messages": [{"role": "user", "content": long}]}
    r = httpx.post(server[0].url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_null_content_is_refused(server):
    body = {**CHAT, "messages": [{"role": "user", "content": None}]}
    r = httpx.post(server[0].url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"


def test_models_say_when_the_model_was_loaded(server, client):
    created = client.models.list().data[0].created
    assert 0 < created <= time.time() and created > time.time() - 3600
