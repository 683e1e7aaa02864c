"""CacheConfig validation and memory-size parsing (torch-free)."""

from __future__ import annotations

import pytest

from expertcache.config import CacheConfig
from expertcache.sizes import format_size, parse_size


@pytest.mark.parametrize("text,expected", [
    ("8GiB", 8 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("4096", 4096),
    (" 2 kib ", 2048), (1234, 1234), ("1T", 10**12),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "8 potatoes", "-1GiB", "0", 0, "1e3GB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_parse_size_types():
    with pytest.raises(TypeError):
        parse_size(True)
    with pytest.raises(TypeError):
        parse_size(8.5)


def test_format_size():
    assert format_size(3 * 1024) == "3.00 KiB" and format_size(1536 * 1024**2) == "1.50 GiB"
    assert format_size(10) == "10 B"


def test_config_defaults_and_baselines():
    cfg = CacheConfig(slots=8)
    assert (cfg.eviction.name, cfg.admission.name, cfg.miss, cfg.partition) == \
        ("default", "freq", "fetch", "global")  # default's own admission (registry.own_admission)
    assert cfg.admission.params["reset"] == 16384
    assert CacheConfig(slots=8, admission="always").admission.name == "always"  # named: it runs
    assert CacheConfig(baseline="cpu").effective().miss == "cpu"
    assert CacheConfig(baseline="cpu").effective().admission.name == "never"
    cep = CacheConfig(baseline="copy-every-pass", miss="cpu").effective()
    assert (cep.admission.name, cep.miss) == ("never", "fetch")
    assert CacheConfig(gpu_memory="1KiB").gpu_memory_bytes == 1024
    assert CacheConfig(slots=4, eviction="slru", eviction_params={"protected": "0.5"}).eviction.params == {"protected": 0.5}


@pytest.mark.parametrize("kwargs,match", [
    (dict(slots=0), "positive"), (dict(slots=True), "positive"), (dict(slots=2, gpu_memory="1GiB"), "either"),
    (dict(partition="ring"), "partition"), (dict(miss="disk"), "miss"), (dict(baseline="fast"), "baseline"),
    (dict(dtype="int8"), "dtype"), (dict(eviction="nope"), "eviction policy"), (dict(admission="nope"), "admission"),
    (dict(eviction="belady"), "oracle"), (dict(staging=0), "staging"), (dict(imatrix_mode="x"), "imatrix_mode"),
    # static with a belady inner policy is an oracle too: only its parameters say so
    (dict(slots=4, eviction="static", eviction_params={"inner": "belady"}), "oracle"),
    (dict(slot_format="int4"), "slot_format"), (dict(host_memory="disk"), "host_memory"),
    (dict(), "needs a size"),
    (dict(eviction="slru", eviction_params={"bogus": 1}), "bogus"),
])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_subpackages_are_attributes_and_import_stays_torch_free():
    """`import expertcache; expertcache.integrations` raised AttributeError (issue 17)."""
    import subprocess
    import sys

    code = ("import sys, expertcache; assert 'torch' not in sys.modules\n"
            "assert expertcache.integrations.__name__ == 'expertcache.integrations'\n"
            "assert expertcache.sim.__name__ == 'expertcache.sim'\n"
            "assert expertcache.config.CacheConfig\n"
            "assert 'torch' not in sys.modules, 'an attribute imported torch'\n"
            "try:\n    expertcache.nothing\nexcept AttributeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "has no attribute 'nothing'" in out.stdout
