"""Reading expert bytes from a model file around the OS page cache.

``DirectFile`` reads byte ranges of one file with ``O_DIRECT``: each range widened to the
4096-byte alignment the kernel wants, read into a page-aligned bounce buffer of the reading
thread, and the payload copied to its destination (a RAM-tier row). Nothing of the file
stays in the page cache, so the reads neither evict nor pollute it, and the bytes a run
reads from disk are exactly the bytes it asked for (plus alignment).

Where ``O_DIRECT`` is refused (tmpfs, some network and overlay file systems answer EINVAL),
reads are buffered and followed by ``posix_fadvise(DONTNEED)`` over the range, so the page
cache still does not keep them; ``mode_reason`` says which it is.

``ReadPool``: a few reader threads. ``os.preadv`` releases the GIL, so reads overlap each
other (an SSD wants several in flight: one 512 KiB O_DIRECT read at a time ran at 0.57 GB/s
on this project's build machine, four at a time 1.8 GB/s) and the compute of the caller.

The file is checked when opened (its size covers every expert range) and before each batch
of reads (``fstat``: size and modification time unchanged since the load), so a file
rewritten under a running model is an error, never silently different weights. Torch-free.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ALIGN = 4096  # O_DIRECT offset, length and buffer alignment (the largest logical block in use)
READERS = 4   # reader threads: enough queue depth for an NVMe drive, few enough for 2 cores


class ExpertReadError(OSError):
    """A read of an expert's bytes failed or came back short (names file, offset and expert)."""


class FileChangedError(RuntimeError):
    """The model file changed since it was loaded: its bytes no longer match the header read."""


@dataclass
class ReadCounters:
    """What the reads cost: ranges read, payload bytes, bytes read from disk (aligned), seconds."""

    reads: int = 0
    bytes: int = 0
    disk_bytes: int = 0
    seconds: float = 0.0

    def add(self, other: ReadCounters) -> None:
        self.reads += other.reads
        self.bytes += other.bytes
        self.disk_bytes += other.disk_bytes
        self.seconds += other.seconds


def _direct_flag() -> int:
    return getattr(os, "O_DIRECT", 0)


class DirectFile:
    """One model file opened for reads of byte ranges that bypass the page cache.

    ``need``: the byte end of the last range that will be read (the header's largest tensor
    end); a shorter file is refused at once. ``direct=False`` forces buffered reads (tests).
    """

    def __init__(self, path: str | Path, need: int, direct: bool = True) -> None:
        self.path = Path(path)
        self.fd, self.direct, self.mode_reason = self._open(direct)
        st = os.fstat(self.fd)
        self._stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        if st.st_size < need:
            os.close(self.fd)
            raise FileChangedError(f"{self.path}: the file has {st.st_size} bytes but its header places "
                                   f"expert bytes up to offset {need}; the file is truncated or was "
                                   "changed after its header was read")
        self._local = threading.local()
        self._closer = weakref.finalize(self, os.close, self.fd)  # the descriptor goes with the object

    def _open(self, direct: bool) -> tuple[int, bool, str]:
        flag = _direct_flag()
        if direct and flag:
            try:
                return os.open(self.path, os.O_RDONLY | flag), True, "O_DIRECT reads (no page cache)"
            except OSError as err:  # EINVAL: the file system refuses O_DIRECT
                why = f"O_DIRECT refused by the file system ({err.strerror})"
        else:
            why = "O_DIRECT not asked for" if flag else "O_DIRECT not available on this platform"
        fd = os.open(self.path, os.O_RDONLY)
        return fd, False, f"{why}: buffered reads, each range dropped from the page cache after it " \
                          "is read (posix_fadvise DONTNEED)"

    def check(self) -> None:
        """Raise ``FileChangedError`` if the file's size, modification time or inode changed."""
        st = os.stat(self.path)
        if (st.st_size, st.st_mtime_ns, st.st_ino) != self._stamp:
            raise FileChangedError(f"{self.path} changed after it was loaded (size {self._stamp[0]} -> "
                                   f"{st.st_size} bytes, or rewritten in place); its expert offsets may no "
                                   "longer hold the same weights: reload the model")

    def _bounce(self, size: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                buf.close()
            buf = self._local.buf = mmap.mmap(-1, size)  # anonymous: page-aligned
        return memoryview(buf)

    def read_into(self, dst: np.ndarray, offset: int, what: str, put=None) -> ReadCounters:
        """Read ``dst.nbytes`` bytes at ``offset`` into ``dst`` (contiguous uint8). ``what`` names
        the expert in errors (e.g. 'layer 3 expert 17 down.weight'). ``put(src)``: writes ``dst``
        from the read bytes at address ``src`` instead of a copy (ggml's repack into a RAM-tier
        row: ``RowRepack.pack``), on this reader thread."""
        n = dst.nbytes
        start = offset - offset % ALIGN
        end = -(-(offset + n) // ALIGN) * ALIGN
        t0 = time.perf_counter()
        view = self._bounce(end - start)[:end - start]
        try:
            got = os.preadv(self.fd, [view], start)
        except OSError as err:
            raise self.failed(err.errno, what, n, offset) from None
        self.land(view[:got], start, offset, dst, what, put)
        return ReadCounters(1, n, end - start, time.perf_counter() - t0)

    def failed(self, code: int, what: str, n: int, offset: int) -> ExpertReadError:
        """The error of a read of ``what`` that failed with errno ``code``."""
        return ExpertReadError(code, f"{self.path}: reading {what} ({n} bytes at offset {offset}) failed: "
                                     f"{os.strerror(code)}")

    def land(self, got, start: int, offset: int, dst: np.ndarray, what: str, put=None) -> None:
        """``got``: the bytes read from the aligned ``start``; ``dst.nbytes`` of them from ``offset`` into
        ``dst`` (or ``put(address)``). A short read names the file, the range and ``what``."""
        n = dst.nbytes
        if len(got) < offset - start + n:
            raise ExpertReadError(f"{self.path}: short read of {what}: {max(len(got) - (offset - start), 0)} of "
                                  f"{n} bytes at offset {offset}; the file is truncated or changed")
        payload = np.frombuffer(got, np.uint8, n, offset - start)
        if put is None:
            np.copyto(dst, payload)
        else:
            put(payload.ctypes.data)
        del payload  # the bounce buffer is exported while a view of it lives
        if not self.direct:
            os.posix_fadvise(self.fd, start, len(got), os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            self._closer()  # closes the descriptor once
            self.fd = -1


class ReadPool:
    """Reader threads shared by one model's files; ``read`` runs a batch of ranges at once."""

    def __init__(self, threads: int = READERS) -> None:
        self.threads = threads
        self.kind = f"{threads} reader threads"
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="expertcache-read")

    def submit(self, jobs: list[tuple], started: threading.Semaphore | None = None):
        """Start ``(file, dst, offset, what[, put])`` reads (``DirectFile.read_into``); returns
        their futures (``ReadCounters``). ``started``: released by each read as a reader thread
        takes it up (``settle``)."""
        if started is None:
            return [self._pool.submit(f.read_into, dst, off, what, *put) for f, dst, off, what, *put in jobs]
        return [self._pool.submit(_begun, started, f.read_into, dst, off, what, *put)
                for f, dst, off, what, *put in jobs]

    def settle(self, started: threading.Semaphore, count: int, timeout: float = 0.01) -> None:
        """Wait until the first ``count`` reads of a batch (at most one per reader thread) are on
        their reader threads. Before a ggml graph takes both cores: its threads spin between
        nodes, and a reader woken then waited for a core about 1.3 ms (the median, 2-core
        sandbox; 0.2 ms once the caller gave them the cores first), most of a MoE layer's compute.
        ``timeout`` per read: a busy pool never stalls the caller long."""
        for _ in range(min(count, self.threads)):
            if not started.acquire(timeout=timeout):
                return

    def read(self, jobs: list[tuple[DirectFile, np.ndarray, int, str]]) -> ReadCounters:
        """Run the reads, wait for all of them; the sum of their counters, ``seconds`` the wall time."""
        t0 = time.perf_counter()
        return self.collect(self.submit(jobs), t0)

    @staticmethod
    def collect(futures, t0: float) -> ReadCounters:
        """Wait for submitted reads; their counters summed, ``seconds`` the wall time since ``t0``."""
        total = ReadCounters()
        error = None
        for fut in futures:  # wait for every read before raising: no read may land later
            try:
                total.add(fut.result())
            except Exception as err:  # noqa: BLE001 (re-raised below)
                error = error or err
        if error is not None:
            raise error
        total.seconds = time.perf_counter() - t0
        return total

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _begun(started: threading.Semaphore, read, *args):
    started.release()
    return read(*args)


def read_bandwidth(path: str | Path, block: int = 1 << 19, threads: int = READERS,
                   limit: int = 256 << 20) -> float:
    """Bytes per second of O_DIRECT reads of ``block`` bytes, ``threads`` at a time, over the first
    ``limit`` bytes of ``path`` (what ``costmodel`` and the tier benchmark take as the disk's rate)."""
    size = min(os.path.getsize(path), limit)
    size -= size % ALIGN
    f = DirectFile(path, 0)
    pool = ReadPool(threads)
    try:
        blk = min(block, size)
        jobs = [(f, np.empty(min(blk, size - off), np.uint8), off, f"block at {off}")
                for off in range(0, size, blk)]
        got = pool.read(jobs)
        return got.bytes / got.seconds if got.seconds > 0 else float("inf")
    finally:
        pool.close()
        f.close()
