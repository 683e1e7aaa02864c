"""``expertcache generate`` and ``expertcache trace record`` on a tiny checkpoint saved to tmp_path."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_moe import save_checkpoint, tiny_model  # noqa: E402

from expertcache.cli import main  # noqa: E402
from expertcache.trace.format import load_trace  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(tiny_model("mixtral"), path)
    return path


def test_generate_prints_text_and_summary(checkpoint, tmp_path, capsys):
    out = tmp_path / "summary.json"
    rc = main(["generate", str(checkpoint), "--prompt", "w1 w2 w3 w4 w5", "--slots", "5",
               "--policy", "lru+second-hit", "--max-new-tokens", "20", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    text = printed.split("\n\n")[0]
    assert len(text.split()) == 20 and all(w.startswith("w") for w in text.split())
    for label in ("prefill", "decode cold", "decode steady", "hit rate", "H2D", "slot pool"):
        assert label in printed
    summary = json.loads(out.read_text())
    assert summary["new_tokens"] == 20 and summary["prompt_tokens"] == 5
    assert summary["decode_cold"]["tokens"] == 16 and summary["decode_steady"]["tokens"] == 3
    cache = summary["cache"]
    assert cache["slots"] == 5 and cache["config"]["admission"] == "second-hit"
    stats = cache["stats"]
    assert stats["prefill"]["accesses"] > 0 and stats["decode"]["accesses"] > 0
    assert cache["h2d_bytes"] == stats["total"]["h2d_bytes"] > 0
    assert 0.0 <= cache["hit_rate"] <= 1.0


def test_generate_same_text_for_every_configuration(checkpoint, capsys):
    texts = []
    for extra in (["--baseline", "resident"], ["--gpu-memory", "200KiB", "--miss", "auto", "--staging", "1"],
                  ["--slots", "4", "--partition", "per-layer", "--miss", "cpu"]):
        assert main(["generate", str(checkpoint), "--prompt", "w9 w8 w7", "--max-new-tokens", "8", *extra]) == 0
        texts.append(capsys.readouterr().out.split("\n\n")[0])
    assert texts[0] == texts[1] == texts[2]


def test_generate_errors_are_one_line(checkpoint, tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "w1", "--slots", "4"]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err
    assert main(["generate", str(checkpoint), "--prompt", "w1", "--slots", "1"]) == 2
    assert "capacity below top-k" in capsys.readouterr().err
    assert main(["generate", str(checkpoint), "--prompt", "w1", "--slots", "4", "--policy", "nope"]) == 2
    assert "unknown eviction policy" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --slots and --gpu-memory exclude each other
        main(["generate", str(checkpoint), "--prompt", "w1", "--slots", "4", "--gpu-memory", "1GiB"])


def test_generate_checks_context_and_size_before_loading(checkpoint, monkeypatch, capsys):
    """`generate --max-new-tokens 1000` on a 128-token context ran past it while serve refused
    the same request (issue 17): one rule (runtime.generate.check_context), checked before the
    model loads, as is a cache below top-k."""
    from expertcache.integrations import transformers as tf
    from expertcache.runtime.generate import ContextError, check_context

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(tf, "offload", no_load)
    assert main(["generate", str(checkpoint), "--prompt", "w1 w2 w3", "--slots", "5",
                 "--max-new-tokens", "1000"]) == 2
    err = capsys.readouterr().err
    assert "exceed the model's context of 128" in err and "--max-new-tokens" in err
    assert main(["generate", str(checkpoint), "--prompt", "w1", "--slots", "1"]) == 2  # below top-k
    err = capsys.readouterr().err
    assert "capacity below top-k" in err and "give at least --slots 2" in err, err
    with pytest.raises(ContextError, match="ask for at most 125 new tokens"):
        check_context(3, 1000, 128)
    check_context(3, 125, 128)  # exactly full is fine, as in serve


def test_trace_record_command(checkpoint, tmp_path):
    out = tmp_path / "t.npz"
    assert main(["trace", "record", str(checkpoint), "--prompt", "w1 w2 w3", "--max-new-tokens", "5",
                 "-o", str(out)]) == 0
    trace = load_trace(out)
    assert trace.phases.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert trace.meta["prefill_steps"] == "batched" and trace.num_experts == 8
