"""``expertcache trace``: import, synth, info and record through the real CLI entry point."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import shared_trace  # tests/ is on sys.path (not a package)
from expertcache.cli import main
from expertcache.trace import Trace, load_trace


def test_synth_then_info(tmp_path, capsys):
    out = tmp_path / "s.npz"
    assert main(["trace", "synth", "--preset", "olmoe", "--tokens", "400", "--seed", "3",
                 "--prompt", "20", "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    trace = load_trace(out)
    assert trace.experts.shape == (16, 400, 8) and int((trace.phases == 0).sum()) == 20
    js = tmp_path / "info.json"
    assert main(["trace", "info", str(out), "--json", str(js)]) == 0
    text = capsys.readouterr().out
    assert "lag1_reuse" in text and "top8_share" in text and "prompt_tokens: 20" in text
    doc = json.loads(js.read_text())
    assert doc["trace"]["tokens"] == 400 and len(doc["layers"]["lag1_reuse"]) == 16
    from expertcache.trace.locality import lag_reuse
    assert doc["layers"]["lag1_reuse"][5] == pytest.approx(lag_reuse(trace.experts, 64)[5], abs=1e-4)
    # same seed, same file contents
    again = tmp_path / "again.npz"
    main(["trace", "synth", "--preset", "olmoe", "--tokens", "400", "--seed", "3", "--prompt", "20",
          "-o", str(again)])
    assert np.array_equal(load_trace(again).experts, trace.experts)


def test_info_json_to_stdout(tmp_path, capsys):
    out = tmp_path / "m.npz"
    main(["trace", "synth", "--preset", "mixtral-8x7b", "--tokens", "50", "-o", str(out)])
    capsys.readouterr()
    assert main(["trace", "info", str(out), "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["chance_lag1_reuse"] == 0.25 and len(doc["layers"]["top1_share"]) == 32


def test_import_route_csv(tmp_path, capsys):
    src = tmp_path / "r.csv"
    src.write_text("# route_trace v1\n# model=m.gguf n_layer=1 n_expert=4 n_expert_used=2\n"
                   "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n"
                   "0,0,0,0,0,1,0.6,0,0\n0,1,1,0,0,2,0.5,0,0\n0,1,1,0,1,3,0.5,0,0\n")
    out = tmp_path / "r.npz"
    assert main(["trace", "import", "--format", "route-csv", str(src), str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 tokens x 1 layers" in text and "dropped 1 incomplete token(s)" in text
    assert load_trace(out).experts[0, 0].tolist() == [2, 3]


def test_import_jsonl_notes_inferred_experts(tmp_path, capsys):
    src = tmp_path / "r.jsonl"
    src.write_text('{"layer": 0, "token_idx": 0, "experts": [0, 3]}\n')
    out = tmp_path / "j.npz"
    assert main(["trace", "import", "--format", "jsonl", str(src), str(out), "--model", "x"]) == 0
    assert "inferred as max id + 1" in capsys.readouterr().err
    assert main(["trace", "import", "--format", "jsonl", str(src), str(out), "--num-experts", "9"]) == 0
    assert load_trace(out).num_experts == 9 and load_trace(out).meta["model"] == "r"  # input stem


def test_import_shared_phone_csv(tmp_path, capsys):
    src = shared_trace("qwen3-30b-a3b-top6-phone.route.csv")
    out = tmp_path / "phone.npz"
    assert main(["trace", "import", "--format", "route-csv", str(src), str(out)]) == 0
    assert "dropped 27 incomplete token(s)" in capsys.readouterr().out
    assert load_trace(out).num_tokens == 129


@pytest.mark.parametrize("argv,message", [
    (["trace", "info", "absent.npz"], "trace file not found: absent.npz"),
    (["trace", "synth", "--preset", "olmoe", "--tokens", "0", "-o", "x.npz"],
     "tokens must be a whole number >= 1"),
    (["trace", "import", "--format", "route-csv", "absent.csv", "x.npz"], "input file not found"),
    (["trace", "import", "--format", "route-csv", "absent.csv", "x.npz", "--num-experts", "4"],
     "--num-experts and --model apply to --format jsonl"),
])
def test_errors_are_one_line_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_file_for_info(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_text("not a trace")
    assert main(["trace", "info", str(bad)]) == 2
    assert "not a .npz archive" in capsys.readouterr().err


def test_record_parser_and_lazy_runtime(tmp_path, monkeypatch, capsys):
    # the parser is ours; the work is integrations.record.record_trace's, imported only when called
    import expertcache.integrations.record as record
    seen = {}

    def fake(model, prompt, output, max_new_tokens, **kwargs):
        seen.update(model=model, prompt=prompt, output=output, max_new_tokens=max_new_tokens, **kwargs)
        meta = {"num_experts": 2, "top_k": 1, "n_moe_layers": 1}
        return Trace(np.zeros((1, 2, 1), np.int16), meta, phase=np.array([0, 1], np.uint8))

    monkeypatch.setattr(record, "record_trace", fake)
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "record", "some/model", "--prompt", "hi", "--max-new-tokens", "3",
                 "--device", "cpu", "-o", "t.npz"]) == 0
    assert seen == {"model": "some/model", "prompt": "hi", "output": "t.npz", "max_new_tokens": 3,
                    "device": "cpu", "router_logits": False}
    with pytest.raises(SystemExit):  # --prompt and --prompt-file exclude each other
        main(["trace", "record", "m", "--prompt", "a", "--prompt-file", "f", "-o", "t.npz"])
    with pytest.raises(SystemExit):  # one of them is required
        main(["trace", "record", "m", "-o", "t.npz"])


def test_trace_without_action_prints_help(capsys):
    assert main(["trace"]) == 2
    assert "import" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["trace", "synth", "--preset", "olmoe", "--tokens", "10", "-o", "{missing}/t.npz"],
    ["trace", "info", "{trace}", "--json", "{missing}/info.json"],
    ["trace", "import", "--format", "jsonl", "{trace}", "{missing}/t.npz"],
    ["trace", "record", "no-such-model", "--prompt", "hi", "-o", "{missing}/t.npz"],
    ["sim", "synth:olmoe", "--tokens", "50", "--json", "{missing}/s.json"],
    ["sim", "synth:olmoe", "--tokens", "50", "--plot", "{missing}/s.png"],
    ["generate", "no-such-model", "--prompt", "hi", "--slots", "8", "--json", "{missing}/g.json"],
    ["bench", "--json", "{missing}/b.json"],
    ["bench", "--plot", "{missing}/b.png"],
    ["imatrix", "{trace}", "--json", "{missing}/i.json"],
    ["probe", "-o", "{missing}/p.json"],
    ["demo", "--out", "{missing}/demo"],
], ids=["synth", "info", "import", "record", "sim-json", "sim-plot", "generate", "bench-json", "bench-plot",
        "imatrix", "probe", "demo"])
def test_an_output_into_a_missing_folder_fails_before_any_work(argv, tmp_path, capsys):
    """One rule for every subcommand: the folder must exist, nothing creates it, and the
    error comes first (record would load a model; import would read the input)."""
    names = {"missing": str(tmp_path / "nope"), "trace": str(tmp_path / "absent.npz")}
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"folder {tmp_path / 'nope'} does not exist" in err and err.count("\n") == 1, err
    assert not (tmp_path / "nope").exists()
