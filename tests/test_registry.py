"""The one policy registry: lookups, parameter checking, bad input, the CLI
listing, and third-party policies through the ``expertcache.policies`` entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from expertcache import EvictionPolicy, SlotTable
from expertcache.cli import main as cli_main
from expertcache.policies import registry
from expertcache.policies.registry import (eviction_policies, make_admission, make_eviction,
                                           parse_spec, register)

PLUGIN_PKG = Path(__file__).parent / "plugin_pkg"


# -- lookups ------------------------------------------------------------------
def test_unknown_eviction_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown eviction policy 'lruu'") as err:
        make_eviction("lruu", 4)
    for name in ("arc", "belady", "lru", "s3fifo", "slru"):
        assert name in str(err.value)


def test_unknown_admission_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="second-hit") as err:
        make_admission("third-hit")
    assert "unknown admission policy 'third-hit'" in str(err.value)


def test_slot_table_reports_unknown_names_the_same_way():
    with pytest.raises(ValueError, match="known eviction policies: .*lfu"):
        SlotTable(2, 4, 4, eviction="nope")
    with pytest.raises(ValueError, match="known admission policies: .*window"):
        SlotTable(2, 4, 4, admission="nope")


@pytest.mark.parametrize("spec, expected", [("lru", ("lru", "always")),
                                            ("slru+second-hit", ("slru", "second-hit")),
                                            (" arc+window ", ("arc", "window"))])
def test_parse_spec(spec, expected):
    assert parse_spec(spec) == expected


def test_parse_spec_rejects_an_empty_eviction():
    with pytest.raises(ValueError, match="EVICTION"):
        parse_spec("+never")


# -- parameters ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(eviction_policies()))
def test_every_eviction_policy_rejects_a_zero_capacity(name):
    with pytest.raises(ValueError, match="capacity"):
        make_eviction(name, 0)


@pytest.mark.parametrize("name, params, match", [
    ("lru", {"size": 3}, "has no parameter.*size.*its parameters: none"),
    ("random", {"seed": -1}, "must not be negative"),
    ("random", {"seed": 1.5}, "whole number"),
    ("random", {"seed": "abc"}, "whole number"),
    ("random", {"seed": True}, "whole number"),
    ("lfu", {"decay": -8}, "must not be negative"),
    ("lfu", {"decay": "2.5"}, "whole number"),
    ("lfru", {"halflife": "soon"}, "must be a number"),
    ("lfru", {"halflife": -1.0}, "must not be negative"),
    ("lfru", {"halflife": float("nan")}, "number >= 0"),
    ("slru", {"protected": 1.5}, r"\[0, 1\)"),
    ("slru", {"protected": -0.5}, "must not be negative"),
    ("s3fifo", {"small": 0}, r"\(0, 1\)"),
    ("static", {"keys": "1,x"}, "whole number >= 0"),
    ("static", {"keys": [-3]}, "whole number >= 0"),
    ("static", {"keys": 7}, "list of ints"),
    ("static", {"inner": "mystery"}, "unknown eviction policy 'mystery'.*lru"),
    ("static", {"inner": "static"}, "cannot use 'static'"),
])
def test_bad_eviction_parameters_are_clear_value_errors(name, params, match):
    with pytest.raises(ValueError, match=match):
        make_eviction(name, 8, **params)


@pytest.mark.parametrize("name, params, match", [
    ("second-hit", {"ghost": 0}, "at least 1"),
    ("second-hit", {"ghost": -5}, "must not be negative"),
    ("window", {"n": 2.5}, "whole number"),
    ("window", {"w": 0}, "at least 1"),
    ("always", {"n": 1}, "has no parameter"),
])
def test_bad_admission_parameters_are_clear_value_errors(name, params, match):
    with pytest.raises(ValueError, match=match):
        make_admission(name, **params)


def test_parameters_given_as_strings_are_coerced():
    # The CLI passes everything as text; the default's type decides.
    assert make_eviction("lfu", 4, decay="12").decay == 12
    assert make_eviction("slru", 10, protected="0.5").protected_cap == 5
    assert make_eviction("static", 10, keys="5, 3 5").pinned_keys() == (3, 5)
    assert make_admission("window", n="3", w="8").n == 3


# -- registration -------------------------------------------------------------
def test_register_refuses_a_taken_name_and_bad_classes():
    class Clash(EvictionPolicy):
        name = "lru"
    with pytest.raises(ValueError, match="already taken"):
        register(Clash)

    class Nameless(EvictionPolicy):
        pass
    with pytest.raises(ValueError, match="non-empty class attribute 'name'"):
        register(Nameless)

    class NotAPolicy:
        name = "thing"
    with pytest.raises(TypeError, match="neither"):
        register(NotAPolicy)


def test_a_registered_policy_is_usable_by_name_and_listed():
    class KeepFirst(EvictionPolicy):  # evicts the newest key: a deliberately odd choice
        name = "test-keep-first"
        description = "test only"

        def __init__(self, capacity, **params):
            super().__init__(capacity)
            self.keys = []

        def on_insert(self, key, now): self.keys.append(key)
        def on_access(self, key, now): pass
        def on_remove(self, key): self.keys.remove(key)

        def victim(self, protected):
            return next((k for k in reversed(self.keys) if k not in protected), None)

    register(KeepFirst)
    try:
        assert "test-keep-first" in eviction_policies()
        table = SlotTable(1, 8, 2, eviction="test-keep-first")
        for e in (0, 1, 2, 3, 0):
            table.step(0, [e])
        assert table.stats().total().hits == 1  # 0 was kept throughout
    finally:
        registry._EVICTION.pop("test-keep-first")


# -- the CLI listing ----------------------------------------------------------
def test_policies_json_lists_every_policy_with_params(capsys):
    assert cli_main(["policies", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["eviction"]) >= 10 and len(info["admission"]) >= 4
    rows = {row["name"]: row for row in info["eviction"] + info["admission"]}
    assert rows["slru"]["params"] == {"protected": 0.8}
    assert rows["window"]["params"] == {"n": 2, "w": 16}
    assert all(set(row) == {"name", "description", "params"} and row["description"]
               for row in rows.values())


def test_policies_table(capsys):
    assert cli_main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "s3fifo" in out and "second-hit" in out and "protected=0.8" in out


# -- third-party plug-in through the entry point ------------------------------
def _expertcache_cmd() -> list[str]:
    return [sys.executable, "-c", "import sys; from expertcache.cli import main; sys.exit(main())"]


RUN_PLUGIN = """
from expertcache import SlotTable
from expertcache.sim import replay
from expertcache.trace.format import Trace
import numpy as np
table = SlotTable(1, 8, 2, eviction="plugin-mru")
for e in (0, 1, 2, 0, 3, 0):
    table.step(0, [e])
ex = np.array([[[0, 1], [2, 3], [0, 1], [2, 3]]], dtype=np.int16)  # L=1, T=4, k=2
sim = replay(Trace(ex, {"model": "test", "num_experts": 8, "top_k": 2, "n_moe_layers": 1}), "plugin-mru", 3, engine="table")
print(table.stats().total().hits, sim.hits, sim.misses)
"""


@pytest.fixture
def installed_plugin(tmp_path):
    """tests/plugin_pkg as an installed distribution, without pip and without touching the active
    environment: its package and a ``.dist-info`` (METADATA, entry_points.txt from its
    pyproject.toml) in a temporary site folder that the subprocesses put on their path.
    ``importlib.metadata`` finds entry points on ``sys.path`` exactly as it finds pip's."""
    import tomllib

    project = tomllib.loads((PLUGIN_PKG / "pyproject.toml").read_text())["project"]
    site = tmp_path / "site"
    shutil.copytree(PLUGIN_PKG / "src", site)
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   f"Version: {project['version']}\n")
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items())
        for group, eps in groups.items()))
    src = Path(__file__).resolve().parents[1] / "src"
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(src)])}


@pytest.mark.slow
def test_entry_point_plugin_is_listed_and_runs(installed_plugin):
    out = subprocess.run(_expertcache_cmd() + ["policies", "--json"], check=True,
                         capture_output=True, text=True, env=installed_plugin).stdout
    names = [row["name"] for row in json.loads(out)["eviction"]]
    assert "plugin-mru" in names and "lru" in names
    run = subprocess.run([sys.executable, "-c", RUN_PLUGIN], check=True, capture_output=True,
                         text=True, env=installed_plugin)
    # Table by hand (MRU, 2 slots): 0, 1 load; 2 evicts 1 (newest); 0 hits; 3 evicts 0 (newest
    # again); 0 misses: 1 hit. Replay by hand (3 slots; steps [0,1] [2,3] [0,1] [2,3]): 3 evicts
    # 1 (2 is in its step); 0 hits, 1 evicts 3 (0 is in its step); 2 hits, 3 evicts 1: 2 hits, 6 misses.
    assert run.stdout.split() == ["1", "2", "6"], run.stdout + run.stderr


def test_needs_future_sees_an_oracle_inside_static():
    # Static's needs_future is set per instance (from its inner policy), so a check on the
    # class alone missed static(inner=belady); needs_future(name, params) asks the class
    # with the parameters, before any table exists.
    from expertcache import SlotTable
    from expertcache.policies.registry import eviction_class, needs_future

    assert needs_future("belady") and not needs_future("lru")
    assert not needs_future("static") and not needs_future("static", {"inner": "lru"})
    assert not eviction_class("static").needs_future  # the class flag alone says no...
    assert needs_future("static", {"keys": "1", "inner": "belady"})  # ...this says yes
    table = SlotTable(1, 8, 4, eviction="static", eviction_params={"inner": "belady"})
    assert table.needs_future
    with pytest.raises(ValueError, match="offline oracle"):
        table.step(0, [1])
