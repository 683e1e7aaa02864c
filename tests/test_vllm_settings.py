"""The vLLM plug-in's configuration block: validated through CacheConfig, one-line errors
naming the key. Torch- and vLLM-free, so it runs in the main environment too."""

from __future__ import annotations

import pytest

from expertcache.vllm.settings import DEFAULT_STATS_EVERY, from_additional_config


def settings(**block):
    return from_additional_config({"expertcache": block})


def test_off_without_the_block():
    assert from_additional_config({}) is None
    assert from_additional_config({"other_plugin": {"x": 1}}) is None


def test_offload_names_reach_cache_config(tmp_path):
    s = settings(slots=12, eviction="slru:protected=0.5", admission="second-hit", partition="per-layer",
                 stats_path=str(tmp_path / "s.json"), record_trace=str(tmp_path / "t.npz"), stats_every=5)
    assert (s.cache.slots, s.cache.eviction.name, s.cache.admission.name, s.cache.partition) == \
        (12, "slru", "second-hit", "per-layer")
    assert s.cache.eviction.params["protected"] == 0.5
    assert (s.stats_every, s.record_trace) == (5, str(tmp_path / "t.npz"))
    whole = settings(slots=4, eviction="lru+second-hit")  # the CLI's whole spec works too
    assert (whole.cache.eviction.name, whole.cache.admission.name) == ("lru", "second-hit")
    assert settings(gpu_memory="1GiB").cache.gpu_memory == "1GiB"
    assert settings(slots=3).stats_every == DEFAULT_STATS_EVERY


@pytest.mark.parametrize("block, words", [
    ({"slots": 8, "eviction": "nope"}, "unknown eviction policy 'nope'"),
    ({"slots": 8, "admission": "maybe"}, "unknown admission policy 'maybe'"),
    ({"slots": 0}, "slots must be a positive whole number"),
    ({"slots": 8, "gpu_memory": "1GiB"}, "either slots or gpu_memory"),
    ({}, "the cache needs a size"),
    ({"slot": 8}, "unknown key(s) 'slot'"),
    ({"slots": 8, "partition": "per-expert"}, "unknown partition"),
    ({"slots": 8, "eviction": "lru+second-hit", "admission": "always"}, "already names an admission"),
    ({"slots": 8, "eviction": 3}, "eviction must be a string"),
    ({"slots": 8, "stats_every": 0}, "stats_every must be a positive"),
    ({"slots": 8, "stats_path": "/no/such/folder/s.json"}, "stats_path: folder"),
    ({"slots": 8, "eviction": "belady"}, "offline oracle"),
])
def test_bad_values_are_one_line_naming_the_key(block, words):
    with pytest.raises(ValueError) as err:
        settings(**block)
    msg = str(err.value)
    assert msg.startswith("expertcache: ") and "\n" not in msg
    assert words in msg


def test_block_must_be_an_object():
    with pytest.raises(ValueError, match="must be a JSON object"):
        from_additional_config({"expertcache": "slots=8"})


def test_planner_key():
    assert settings(slots=8).planner == "host" and settings(slots=8).cache.planner == "auto"  # auto: host in vLLM
    assert settings(slots=8, planner="host").planner == "host"
    assert settings(slots=8, planner="device").planner == "device"
    assert (settings(slots=8, planner="device", lag=2).cache.lag, settings(slots=8).cache.lag) == (2, 1)
    for block, words in (({"slots": 8, "planner": "gpu"}, "expertcache: unknown planner 'gpu'"),
                         ({"slots": 8, "planner": "device", "lag": 0}, "lag must be a whole number"),
                         ({"slots": 8, "planner": "device", "record_trace": "t.npz"}, "record_trace needs planner")):
        with pytest.raises(ValueError) as err:
            settings(**block)
        assert words in str(err.value) and "\n" not in str(err.value)
