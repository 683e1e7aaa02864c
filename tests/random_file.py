"""A file of random bytes for the read tests (test_tiers.py, test_kernelaio.py)."""

from __future__ import annotations

import numpy as np

from expertcache.runtime.directio import ALIGN


def random_file(tmp_path, n=3 * ALIGN + 100):
    """``tmp_path/data.bin`` holding ``n`` random bytes; its path and the bytes."""
    path = tmp_path / "data.bin"
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return path, data
