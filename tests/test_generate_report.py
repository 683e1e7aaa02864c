"""``generate`` for people: streamed text, three decode phases, sampling, --chat, and the
Python API's report() and readable stats."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
from tiny_chat import chat_tokenizer  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

import expertcache  # noqa: E402
from expertcache.cli import main  # noqa: E402
from expertcache.runtime.generate import generate_and_measure  # noqa: E402
from expertcache.runtime.sampling import Sampling  # noqa: E402
from expertcache.runtime.text import StreamText  # noqa: E402


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("chatckpt")
    tiny_model("mixtral").save_pretrained(path)
    chat_tokenizer().save_pretrained(path)
    return path


def test_text_streams_while_generating():
    model = expertcache.offload(tiny_model("mixtral"), slots=5)
    tok = chat_tokenizer()
    seen = []  # (delta, forwards done when it arrived)
    clock = model._expertcache_clock
    text, summary = generate_and_measure(model, tok, "w1 w2 w3", 30,
                                         on_text=lambda d: seen.append((d, len(clock.times))))
    assert "".join(d for d, _ in seen) == text and summary["new_tokens"] == 30
    assert seen[0][1] < seen[-1][1] <= 31  # the first words came before the last forward


def test_three_decode_phases_and_steady_h2d():
    model = expertcache.offload(tiny_model("mixtral"), slots=5)
    _, s = generate_and_measure(model, chat_tokenizer(), "w1 w2 w3", 100)
    # 99 decode steps: cold 16, warm to 99 // 4 = 24, steady the rest (as the bench splits)
    assert [s[f"decode_{p}"]["tokens"] for p in ("cold", "warm", "steady")] == [16, 8, 75]
    steady = s["decode_steady"]
    assert steady["tok_s"] > 0 and 0 <= steady["hit_rate"] <= 1
    # the phases' bytes add up to the decode total the cache counted
    total = sum(s[f"decode_{p}"]["h2d_bytes_per_token"] * s[f"decode_{p}"]["tokens"]
                for p in ("cold", "warm", "steady"))
    assert total == pytest.approx(s["cache"]["stats"]["decode"]["h2d_bytes"])


def test_report_and_stats_print_as_tables():
    model = expertcache.offload(tiny_model("mixtral"), slots=5)
    with torch.no_grad():
        model.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=40, do_sample=False, pad_token_id=0)
    stats = model.expertcache.stats()
    text = str(stats)
    assert "object at 0x" not in repr(stats) and repr(stats) == text
    assert text.splitlines()[0].split() == ["accesses", "hits", "misses", "loads", "evictions", "bypasses",
                                            "hit", "rate", "H2D"]
    assert text.splitlines()[2].split()[1] == str(stats.total("decode").accesses)
    report = model.expertcache.report()
    assert report["new_tokens"] == 40 and report["prompt_tokens"] == 4
    # 39 decode steps: cold 16, warm none (39 // 4 < 16), steady 23
    assert [report[f"decode_{p}"]["tokens"] for p in ("cold", "warm", "steady")] == [16, 0, 23]
    assert report["cache"]["stats"] == stats.to_dict()
    for label in ("prefill", "decode cold", "decode warm", "decode steady", "hit rate", "slot pool", "policy"):
        assert label in str(report)
    json.dumps(report)  # still JSON-ready


def test_report_before_any_generation_says_so():
    model = expertcache.offload(tiny_model("mixtral"), slots=5)
    with pytest.raises(ValueError, match="no generation measured yet"):
        model.expertcache.report()


def test_one_request_share_of_the_stats():
    model = expertcache.offload(tiny_model("mixtral"), slots=5)
    tok = chat_tokenizer()
    generate_and_measure(model, tok, "w1 w2", 10)
    before = model.expertcache.stats()
    _, s = generate_and_measure(model, tok, "w4 w5", 10)
    share = model.expertcache.stats().since(before)
    assert s["cache"]["stats"] == share.to_dict() and share.total().accesses > 0
    assert share.total().accesses == model.expertcache.stats().total().accesses - before.total().accesses


def test_stop_strings_are_held_back_and_cut():
    tok = chat_tokenizer()
    stream = StreamText(tok, stop=("w8 w9",))
    ids = tok("w1 w8 w2 w8 w9 w3").input_ids
    out = [stream.add([i]) for i in ids]
    assert out[1] == " " and out[2] == "w8 w2"  # 'w8' could have begun the stop string: held back
    assert stream.stopped and "".join(out) + stream.finish() == "w1 w8 w2 "


def test_sampling_is_checked_and_seeded():
    with pytest.raises(ValueError, match="temperature must be between 0 and 2"):
        Sampling(temperature=3)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="at most 4"):
        Sampling(stop=("a", "b", "c", "d", "e"))
    model = expertcache.offload(tiny_model("mixtral"), slots=6)
    tok, how = chat_tokenizer(), Sampling(temperature=1.0, top_k=10, seed=5)
    texts = [generate_and_measure(model, tok, "w1", 20, how)[0] for _ in range(2)]
    greedy = generate_and_measure(model, tok, "w1", 20)[0]
    assert texts[0] == texts[1] != greedy


def test_cli_chat_sampling_and_policy_params(chat_checkpoint, capsys, tmp_path):
    out = tmp_path / "s.json"
    argv = ["generate", str(chat_checkpoint), "--prompt", "w5 w6", "--chat", "--slots", "5",
            "--policy", "slru:protected=0.5+second-hit:ghost=64", "--max-new-tokens", "24", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for label in ("decode cold", "decode warm", "decode steady", "policy"):
        assert label in printed
    summary = json.loads(out.read_text())
    assert summary["prompt_tokens"] == 4  # <|user|> w5 w6 <|assistant|>
    config = summary["cache"]["config"]
    assert config["eviction_params"] == {"protected": 0.5} and config["admission_params"] == {"ghost": 64}
    assert main([*argv[:-2], "--temperature", "0.7", "--seed", "1", "--top-p", "0.9"]) == 0
    assert main([*argv[:-2], "--temperature", "9"]) == 2
    assert "temperature must be between 0 and 2" in capsys.readouterr().err


def test_cli_chat_without_a_template_says_so(tmp_path, capsys):
    from tiny_moe import save_checkpoint

    save_checkpoint(tiny_model("mixtral"), tmp_path)  # its tokenizer has no chat template
    assert main(["generate", str(tmp_path), "--prompt", "w1", "--chat", "--slots", "5"]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_finish_reasons_stop_at_the_end_token_length_at_the_limit():
    from expertcache.runtime.generate import run_generation

    model = expertcache.offload(tiny_model("mixtral"), slots=6)
    tok = chat_tokenizer()
    ids = tok("w1 w2 w3").input_ids
    full = run_generation(model, tok, ids, 8)
    assert full.finish_reason == "length" and len(full.token_ids) == 8
    eos = full.token_ids[2]  # this token now ends the answer, where it first comes
    model.generation_config.eos_token_id = eos
    ended = run_generation(model, tok, ids, 8)
    assert ended.finish_reason == "stop" and ended.token_ids == full.token_ids[:full.token_ids.index(eos) + 1]
    cut = run_generation(model, tok, ids, 8, cancelled=lambda: True)  # a client that left at once
    assert cut.finish_reason == "cancelled" and len(cut.token_ids) == 1
