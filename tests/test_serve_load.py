"""Eight clients at once, one of them leaving mid-stream: nothing lost, nothing corrupted."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from tiny_chat import chat_tokenizer  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

import expertcache  # noqa: E402
from expertcache.serve import Server, ServeSettings  # noqa: E402

NAME = "tiny"
CLIENTS, REQUESTS = 8, 4


def request_of(client: int, i: int) -> dict:
    """Varied prompts, lengths and kinds: completion / chat, streamed or not."""
    words = " ".join(f"w{(client * 7 + i * 3 + j) % 80 + 1}" for j in range(2 + (client + i) % 4))
    return {"chat": (client + i) % 2 == 0, "stream": (client * 3 + i) % 3 != 0, "text": words,
            "max_tokens": 6 + (client + 2 * i) % 9}


def ids_of(tokenizer, req: dict) -> list[int]:
    if req["chat"]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": req["text"]}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(req["text"]).input_ids


def ask(client: openai.OpenAI, req: dict) -> str:
    kw = dict(model=NAME, max_tokens=req["max_tokens"], temperature=0, stream=req["stream"])
    if req["chat"]:
        r = client.chat.completions.create(messages=[{"role": "user", "content": req["text"]}], **kw)
        if req["stream"]:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        return r.choices[0].message.content
    r = client.completions.create(prompt=req["text"], **kw)
    return "".join(c.choices[0].text for c in r if c.choices) if req["stream"] else r.choices[0].text


def consistent(cache, ptrs) -> None:
    """The table's resident experts sit in distinct cache slots holding exactly their weights."""
    resident = cache.table.resident()
    slots = list(resident.values())
    assert len(set(slots)) == len(slots) and all(0 <= s < cache.pool.slots for s in slots)
    for key, slot in resident.items():
        layer, expert = divmod(key, cache.num_experts)
        for kind, pool in cache.pool.tensors.items():
            assert torch.equal(pool[slot], cache.hosts[layer].tensors[kind][expert])
    assert cache.pool.data_ptrs() == ptrs  # the pool never moved or grew


def idle(worker, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while worker.running is not None or worker.jobs.qsize():
        assert time.monotonic() < deadline, "the worker is still busy"
        time.sleep(0.01)


def test_concurrent_clients_and_a_disconnect(tmp_path):
    tokenizer = chat_tokenizer()
    reference = tiny_model("mixtral")
    model = expertcache.offload(tiny_model("mixtral"), slots=5, eviction="lru", admission="second-hit")
    ptrs = model.expertcache.pool.data_ptrs()
    plan = {(c, i): request_of(c, i) for c in range(CLIENTS) for i in range(REQUESTS)}
    want = {}
    with torch.no_grad():
        for key, req in plan.items():
            ids = ids_of(tokenizer, req)
            out = reference.generate(torch.tensor([ids]), max_new_tokens=req["max_tokens"], do_sample=False,
                                     pad_token_id=0)
            want[key] = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    got, errors = {}, []
    with Server(model, tokenizer, ServeSettings(NAME, port=0, max_tokens=200)) as srv:
        def run_client(c):
            try:
                with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=60, max_retries=0) as client:
                    for i in range(REQUESTS):
                        got[c, i] = ask(client, plan[c, i])
            except Exception as err:  # noqa: BLE001  reported below with the client's number
                errors.append((c, err))

        def leave_mid_stream():
            try:
                half_read()
            except Exception as err:  # noqa: BLE001
                errors.append(("leaver", err))

        def half_read():
            body = {"model": NAME, "prompt": "w3 w4 w5", "max_tokens": 100, "temperature": 0, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 4:
                        break  # closes the connection with the answer half done

        threads = [threading.Thread(target=run_client, args=(c,)) for c in range(CLIENTS)]
        threads.append(threading.Thread(target=leave_mid_stream))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads)
        assert got == want  # every answer complete and equal to the uncached model's

        idle(srv.service.worker)  # the cut-off job ends a token or so after its client left
        stats = httpx.get(srv.url + "/v1/expertcache/stats", timeout=30).json()
        assert stats["requests"] == CLIENTS * REQUESTS + 1
        # no eos in this vocabulary: every other request made exactly max_tokens; the leaver was cut short
        cut = stats["completion_tokens"] - sum(r["max_tokens"] for r in plan.values())
        assert 2 <= cut < 100
        assert httpx.get(srv.url + "/health", timeout=30).json() == {"status": "ok", "queued": 0}
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:  # still serving
            assert ask(client, plan[0, 0]) == want[0, 0]
        consistent(model.expertcache, ptrs)
        assert srv.service.worker.running is None
