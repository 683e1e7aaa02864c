"""Kernel AIO reads (runtime/kernelaio.py): the RAM tier's reader where Linux and O_DIRECT allow.

``AioPool`` must read what ``ReadPool`` reads, byte for byte, at any offset; refuse short and
failed reads with the file, offset and expert named, only after every read of the batch is
done; and ``open_aio`` must say why it fell back (the tier then keeps its reader threads).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from expertcache.runtime import kernelaio
from expertcache.runtime.directio import ALIGN, DirectFile, ExpertReadError
from expertcache.runtime.kernelaio import AioPool, open_aio
from random_file import random_file  # tests/ is on sys.path (not a package)


@pytest.fixture
def aio_file(tmp_path):
    """A data file opened with O_DIRECT and an ``AioPool`` over it; skipped (with the reason) where
    this machine's file system or kernel allows neither."""
    path, data = random_file(tmp_path, 300 * ALIGN + 333)
    f = DirectFile(path, len(data))
    if not f.direct:
        f.close()
        pytest.skip(f"kernel AIO needs O_DIRECT, which {tmp_path} refuses: {f.mode_reason}")
    pool, why = open_aio([f])
    if pool is None:
        f.close()
        pytest.skip(f"no kernel AIO here: {why}")
    yield path, data, f, pool
    pool.close()
    f.close()


RANGES = [(0, 10), (5, ALIGN), (ALIGN - 3, 7), (2 * ALIGN + 1, ALIGN + 99), (296 * ALIGN, 4 * ALIGN + 333),
          (ALIGN + 7, 128 * ALIGN + 5000)]


def test_unaligned_ranges_read_exactly(aio_file):
    """The ranges test_tiers.py reads through reader threads, one to the end of the file, one
    the size of a real expert part (half a MiB)."""
    _, data, f, pool = aio_file
    jobs = [(f, np.empty(n, np.uint8), off, f"range {off}") for off, n in RANGES]
    got = pool.read(jobs)
    for _, dst, off, _ in jobs:
        assert np.array_equal(dst, data[off:off + dst.nbytes])
    assert got.reads == len(RANGES) and got.bytes == sum(n for _, n in RANGES)
    assert got.disk_bytes % ALIGN == 0 and got.disk_bytes >= got.bytes and got.seconds > 0


def test_put_lands_each_payload_and_buffers_are_reused(aio_file):
    """``put(address)`` (the repack into a row) sees the payload's bytes; a second batch of the same
    sizes takes its bounce buffers from the free list, not new ones."""
    _, data, f, pool = aio_file
    seen = {}

    def put_for(off, n):
        return lambda address: seen.__setitem__(off, np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n)
                                                                          .from_address(address)).copy())
    jobs = [(f, np.empty(n, np.uint8), off, "x", put_for(off, n)) for off, n in RANGES]
    pool.read(jobs)
    assert all(np.array_equal(seen[off], data[off:off + n]) for off, n in RANGES)
    buffers = sum(len(b) for b in pool._free.values())
    pool.read([(f, np.empty(n, np.uint8), off, "x") for off, n in RANGES])
    assert sum(len(b) for b in pool._free.values()) == buffers


def test_more_reads_than_the_context_holds(aio_file):
    """A batch past the context's depth is submitted in turns (reaping between) and every read lands."""
    _, data, f, pool = aio_file
    rng = np.random.default_rng(1)
    jobs = []
    for _ in range(kernelaio._DEPTH + 60):
        off, n = int(rng.integers(0, len(data) - 5000)), int(rng.integers(1, 5000))
        jobs.append((f, np.empty(n, np.uint8), off, f"range {off}"))
    got = pool.read(jobs)
    assert got.reads == len(jobs) and not pool._flight
    assert all(np.array_equal(dst, data[off:off + dst.nbytes]) for _, dst, off, _ in jobs)


def test_a_batch_read_in_two_collects(aio_file):
    """Two batches in flight at once, collected in either order (the graph's read-ahead and a step's
    own reads share the context)."""
    _, data, f, pool = aio_file
    first = [(f, np.empty(3000, np.uint8), off, "a") for off in (0, 9000, 40000)]
    second = [(f, np.empty(5000, np.uint8), off, "b") for off in (777, 20000)]
    a, b = pool.submit(first), pool.submit(second)
    assert pool.collect(b, 0.0).reads == 2 and pool.collect(a, 0.0).reads == 3
    for _, dst, off, _ in first + second:
        assert np.array_equal(dst, data[off:off + dst.nbytes])


def test_a_read_bound_after_its_submit(aio_file):
    """A read started without a destination (the tier's step reads its missing experts before the
    table chooses their rows) lands where ``bind`` names; one never bound is collected and lands
    nowhere; a destination of another size is refused."""
    _, data, f, pool = aio_file
    (off, n), (off2, n2) = RANGES[3], RANGES[5]
    reads = pool.submit([(f, None, off, "bound", None, n), (f, None, off2, "never bound", None, n2)])
    with pytest.raises(ValueError, match=rf"a read of {n} bytes \(bound\) bound to {n + 1} bytes"):
        pool.bind(reads[0], np.empty(n + 1, np.uint8))
    dst = np.empty(n, np.uint8)
    pool.bind(reads[0], dst)
    got = pool.collect(reads, 0.0)
    assert np.array_equal(dst, data[off:off + n])
    assert got.reads == 1 and got.bytes == n and not pool._flight


def test_short_read_names_file_offset_and_expert_after_the_batch(aio_file):
    path, data, f, pool = aio_file
    os.truncate(path, 8 * ALIGN)  # the file shrinks under us
    fine = np.empty(100, np.uint8)
    jobs = [(f, fine, 10, "layer 0 expert 1 (up.weight)"),
            (f, np.empty(20 * ALIGN, np.uint8), 5, "layer 1 expert 7 (down.weight)")]
    with pytest.raises(ExpertReadError, match=rf"{path.name}: short read of layer 1 expert 7 .*: {8 * ALIGN - 5} of "
                                              rf"{20 * ALIGN} bytes at offset 5; the file is truncated"):
        pool.read(jobs)
    assert not pool._flight and np.array_equal(fine, data[10:110])  # the batch's other read landed


def test_read_error_names_file_offset_and_expert(aio_file):
    path, _, f, pool = aio_file
    real = f.fd
    f.fd = os.open(os.devnull, os.O_WRONLY)  # io_submit refuses a read of a write-only descriptor: EBADF
    try:
        with pytest.raises(ExpertReadError, match=r"data.bin: reading layer 0 expert 3 .*offset 4096.* failed: "
                                                  r"Bad file descriptor"):
            pool.read([(f, np.empty(100, np.uint8), 4096, "layer 0 expert 3 (up.weight)")])
    finally:
        os.close(f.fd)
        f.fd = real
    assert not pool._flight
    dst = np.empty(100, np.uint8)  # the context still serves reads after the error
    pool.read([(f, dst, 4096, "again")])


def test_open_aio_says_why_not(tmp_path, monkeypatch):
    path, data = random_file(tmp_path)
    buffered = DirectFile(path, len(data), direct=False)
    assert open_aio([buffered]) == (None, "kernel AIO only with O_DIRECT")
    buffered.close()
    direct = DirectFile(path, len(data))
    monkeypatch.setenv("EXPERTCACHE_AIO", "0")
    pool, why = open_aio([direct])
    assert pool is None and (why == "kernel AIO turned off (EXPERTCACHE_AIO=0)" or not direct.direct)
    monkeypatch.delenv("EXPERTCACHE_AIO")
    monkeypatch.setattr(kernelaio.platform, "machine", lambda: "sparc64")
    pool, why = open_aio([direct])
    assert pool is None and ("no kernel AIO on" in why and "sparc64" in why or not direct.direct)
    direct.close()


def test_io_setup_refused_is_a_reason_not_an_error(tmp_path, monkeypatch):
    path, data = random_file(tmp_path)
    f = DirectFile(path, len(data))
    if not f.direct:
        f.close()
        pytest.skip(f"O_DIRECT refused here: {f.mode_reason}")

    def refuse(self, calls, libc):
        raise OSError(1, "Operation not permitted")
    monkeypatch.setattr(AioPool, "__init__", refuse)
    assert open_aio([f]) == (None, "io_setup refused (Operation not permitted)")
    f.close()


def test_zeroed_rows_are_committed_zeros_on_an_aligned_map():
    """``host.zeroed`` (the RAM tier's rows; ``huge_map`` also carves the bounce buffers):
    zeros, writable, 2 MiB-aligned, and resident once it returns (its pages faulted in)."""
    from expertcache.runtime.host import zeroed

    def rss() -> int:
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS:")).split()[1]) << 10

    n = (64 << 20) + 12345
    before = rss()
    out = zeroed(n)
    grown = rss() - before
    assert out.shape == (n,) and out.dtype.itemsize == 1 and out.data_ptr() % (2 << 20) == 0
    assert not out.any()
    assert grown > 0.9 * n, f"only {grown} of {n} bytes resident after zeroed()"
    out[-1] = 7  # writable to the last byte
    assert int(out[-1]) == 7
