"""Policy parameters on the command line: ``registry.parse_policy`` and the CLIs that use it."""

from __future__ import annotations

import pytest

from expertcache.policies.registry import check_params, eviction_class, parse_policy


def test_names_and_params_of_both_sides():
    p = parse_policy("slru:protected=0.5+window:n=3:w=32")
    assert (p.eviction.name, p.admission.name) == ("slru", "window")
    assert p.eviction.params == {"protected": 0.5}
    assert p.admission.params == {"n": 3, "w": 32}
    assert str(p) == "slru:protected=0.5+window:n=3:w=32"


def test_defaults_fill_in_and_plain_names_still_work():
    p = parse_policy("lru")
    assert (p.eviction.name, p.eviction.params, p.admission.name, p.admission.params) == \
        ("lru", {}, "always", {})
    assert parse_policy(" slru + second-hit ").admission.params == {"ghost": 4096}
    assert parse_policy("slru").eviction.params == {"protected": 0.8}


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
    assert cfg.eviction.params == {"protected": 0.25} and cfg.admission.params == {"n": 3, "w": 16}
    # the bench hands replay the resolved specs themselves, not a string to parse again
    assert s.sim_policy.spec == (cfg.eviction, cfg.admission)
    assert s.label == "slru:protected=0.25+window:n=3"


# -- one PolicySpec, checked before anything loads (issue 17) ------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(eviction="slru:protected=1.5"), r"parameter 'protected' of policy 'slru'.*\[0, 1\).*1.5"),
    (dict(eviction="slru", eviction_params={"protected": 1.5}), r"'protected'.*\[0, 1\)"),
    (dict(admission="second-hit:ghost=0"), r"parameter 'ghost' of policy 'second-hit' must be at least 1"),
    (dict(admission="second-hit", admission_params={"ghost": 0}), r"'ghost'.*at least 1"),
    (dict(admission="window:n=0"), r"'n' and 'w' of policy 'window' must be at least 1"),
    (dict(eviction="s3fifo:small=1"), r"'small'.*\(0, 1\)"),
    (dict(eviction="next-use:horizon=99"), r"'horizon'.*must be 1\.\."),
    (dict(eviction="lru+second-hit"), "unknown eviction policy 'lru\\+second-hit'"),
    (dict(eviction=3), "a name such as 'lru'"),
])
def test_cache_config_checks_policy_ranges_at_construction(kwargs, match):
    from expertcache.config import CacheConfig

    with pytest.raises((ValueError, TypeError), match=match) as err:
        CacheConfig(slots=8, **kwargs)
    assert "\n" not in str(err.value)


def test_cache_config_holds_specs_and_stays_json_friendly():
    import json

    from expertcache.config import CacheConfig
    from expertcache.policies.registry import PolicySpec, eviction_spec

    cfg = CacheConfig(slots=8, eviction="slru:protected=0.5", admission="second-hit",
                      admission_params={"ghost": 64})
    assert isinstance(cfg.eviction, PolicySpec) and isinstance(cfg.admission, PolicySpec)
    assert cfg.eviction == eviction_spec("slru", {"protected": 0.5})
    assert (str(cfg.eviction), str(cfg.admission)) == ("slru:protected=0.5", "second-hit:ghost=64")
    doc = json.loads(json.dumps(cfg.to_dict()))
    assert doc["eviction"] == "slru" and doc["eviction_params"] == {"protected": 0.5}
    assert doc["admission_params"] == {"ghost": 64}
    again = CacheConfig(**{k: v for k, v in doc.items()})  # to_dict() rebuilds the same config
    assert again == cfg
    assert CacheConfig(slots=8, eviction=cfg.eviction).eviction is cfg.eviction  # no second resolve
    from dataclasses import replace
    assert replace(cfg, eviction="lru").eviction.params == {}  # slru's parameters do not follow
    assert replace(cfg, baseline="cpu").effective().admission.name == "never"


def test_a_spec_is_looked_up_once(monkeypatch):
    """From the spec to the table, the registry is not asked for the name again."""
    from expertcache import SlotTable
    from expertcache.config import CacheConfig
    from expertcache.policies import registry

    cfg = CacheConfig(slots=8, eviction="slru:protected=0.5", admission="second-hit")
    calls = []
    real = registry._lookup
    monkeypatch.setattr(registry, "_lookup", lambda *a: calls.append(a) or real(*a))
    table = SlotTable(2, 8, 8, eviction=cfg.eviction, admission=cfg.admission)
    assert calls == [] and table.step(0, [1, 2]).loads


def test_bad_policy_config_fails_fast_without_loading_a_model():
    """`generate --policy slru:protected=1.5` fails before torch or a model is touched."""
    import subprocess
    import sys
    import time

    code = ("import sys\nfrom expertcache.cli import main\nrc = main(['generate', 'nowhere', '--slots', '8', "
            "'--policy', 'slru:protected=1.5', '--prompt', 'x'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(rc)")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert time.perf_counter() - start < 10  # loose: a loaded shared machine; typically ~1 s
    assert "'protected'" in run.stderr and "[0, 1)" in run.stderr and "Traceback" not in run.stderr
