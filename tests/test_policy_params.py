"""Policy parameters on the command line: ``registry.parse_policy`` and the CLIs that use it."""

from __future__ import annotations

import pytest

from expertcache.policies.registry import check_params, eviction_class, parse_policy


def test_names_and_params_of_both_sides():
    p = parse_policy("slru:protected=0.5+window:n=3:w=32")
    assert (p.eviction, p.admission) == ("slru", "window")
    assert p.eviction_params == {"protected": 0.5}
    assert p.admission_params == {"n": 3, "w": 32}


def test_defaults_fill_in_and_plain_names_still_work():
    assert parse_policy("lru") == ("lru", {}, "always", {})
    assert parse_policy(" slru + second-hit ").admission_params == {"ghost": 4096}
    assert parse_policy("slru").eviction_params == {"protected": 0.8}


@pytest.mark.parametrize("spec, match", [
    ("slru:size=3", "policy 'slru' has no parameter"),
    ("slru:protected=lots", "must be a number, got 'lots'"),
    ("lru+window:n=2.5", "must be a whole number"),
    ("slru:protected", "bad policy parameter 'protected'"),
    ("slru:=1", "bad policy parameter"),
    ("lru+second-hit+window", "more than one '\\+'"),
    (":protected=1", "empty policy"),
    ("nope:x=1", "unknown eviction policy 'nope'"),
    ("lru+nope", "unknown admission policy 'nope'"),
])
def test_bad_specs_fail_with_the_python_api_messages(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(spec)


def test_same_message_as_the_python_api():
    with pytest.raises(ValueError) as api:
        check_params(eviction_class("slru"), {"size": "3"})
    with pytest.raises(ValueError) as cli:
        parse_policy("slru:size=3")
    assert str(api.value) == str(cli.value)


def test_generate_and_serve_reject_bad_parameters_before_loading(tmp_path, capsys):
    from expertcache.cli import main

    for command in (["generate", str(tmp_path), "--prompt", "w1"], ["serve", str(tmp_path)]):
        assert main([*command, "--slots", "4", "--policy", "slru:protected=x"]) == 2
        err = capsys.readouterr().err
        assert "parameter 'protected' of policy 'slru' must be a number" in err


def test_sim_runs_parameters_and_labels_them(tmp_path):
    import json

    from expertcache.cli import main

    out = tmp_path / "sim.json"
    assert main(["sim", "synth:olmoe", "--tokens", "200", "--slots", "200", "--json", str(out),
                 "--policy", "slru:protected=0.1,slru:protected=0.9,lru+window:n=3:w=8"]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) >= {"slru:protected=0.1", "slru:protected=0.9", "lru+window:n=3:w=8"}
    assert rows["slru:protected=0.1"]["misses"] != rows["slru:protected=0.9"]["misses"]


def test_sim_table_and_kernel_agree_on_parameters():
    from expertcache.sim.replay import replay
    from expertcache.trace.synth import synth_trace

    trace = synth_trace("olmoe", 150, seed=1)
    for spec in ("slru:protected=0.3", "lru+second-hit:ghost=16", "s3fifo:small=0.3"):
        fast = replay(trace, spec, 160, engine="fast").stats.total()
        table = replay(trace, spec, 160, engine="table").stats.total()
        assert fast == table, spec


def test_bench_strategies_carry_parameters():
    from expertcache.bench.strategies import plan

    s = [x for x in plan(["slru:protected=0.25+window:n=3"], [64], baselines=(), optimum=False)][0]
    cfg = s.config()
    assert cfg.eviction_params == {"protected": 0.25} and cfg.admission_params == {"n": 3, "w": 16}
    assert s.sim_policy == "slru:protected=0.25+window:n=3:w=16" and s.label == "slru:protected=0.25+window:n=3"
