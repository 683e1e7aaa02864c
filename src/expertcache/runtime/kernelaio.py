"""Reads of expert bytes through Linux's native AIO (``io_submit``), no reader threads.

``AioPool`` has ``ReadPool``'s interface (runtime/directio.py: ``submit``, ``settle``,
``collect``, ``read``, ``close``) for ``O_DIRECT`` files. A step's reads go to the kernel in one
``io_submit`` call, all in flight at once; their completions need no thread of ours. With
reader threads each read had to be picked up, and each completion handled, by a Python thread
that then waited for a core behind the ggml graph's two spinning workers (2-core sandbox,
median 1.3 ms a wake-up). Five 432 KiB expert parts took 1.24-1.29 ms this way against 1.77 ms
on four reader threads, idle or beside two busy processes (docs/tiers.md, "Kernel AIO").

Each read lands in a page-aligned bounce buffer (``O_DIRECT`` wants 4096-byte alignment of
offset, length and address); ``collect`` copies (or repacks, ``put``) its payload into the
destination row on the caller's thread, each as it completes, while the others still run.
A read may start before its destination is known (``dst`` None) and be given one later
(``bind``): the tier reads a step's missing experts before its table has chosen their rows.

Bounce buffers are carved from anonymous maps advised ``MADV_HUGEPAGE`` (``host.huge_map``):
``io_submit`` pins a read's buffer pages, and on 2 MiB pages that took 36 us for three 432 KiB
reads against 86 us on 4 KiB pages (EPYC sandbox, transparent huge pages on; where they are off
it changes nothing).

Only with ``O_DIRECT`` (buffered reads under kernel AIO run synchronously inside
``io_submit``), on little-endian x86_64 and aarch64 (the syscall numbers and ``struct iocb``
layout of ``linux/aio_abi.h`` are spelled out here: no libaio on the machines this runs on),
and where ``io_setup`` succeeds (a seccomp filter or ``fs.aio-max-nr`` can refuse it):
``open_aio`` says why not, and the tier keeps its reader threads.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import threading
import time

import numpy as np

from .directio import ALIGN, DirectFile, ReadCounters
from .host import huge_map

# (io_setup, io_destroy, io_getevents, io_submit): arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h (aarch64)
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2), "arm64": (0, 1, 4, 2)}
_DEPTH = 256         # reads in flight at most (the context's events): a step reads far fewer
_PREAD = 0           # IOCB_CMD_PREAD
_CHUNK = 16 << 20    # bounce buffers are carved from maps of this size (or one read's, if larger)


class _Iocb(ctypes.Structure):  # struct iocb, little-endian (aio_key before aio_rw_flags)
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fd", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):  # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class _Read:
    """One range in flight: where it goes, its bounce buffer, and (once reaped) its result."""

    __slots__ = ("file", "dst", "offset", "what", "put", "nbytes", "start", "buf", "iocb", "t0", "res", "seconds")

    def __init__(self, file: DirectFile, dst: np.ndarray | None, offset: int, what: str, put=None,
                 nbytes: int | None = None) -> None:
        self.file, self.dst, self.offset, self.what, self.put = file, dst, offset, what, put
        self.nbytes = dst.nbytes if nbytes is None else nbytes  # dst None: named later (``bind``)
        self.res: int | None = None  # bytes read, or -errno

    def done(self) -> bool:
        return self.res is not None


class AioPool:
    """``ReadPool``'s interface over one kernel AIO context (see the module's docstring)."""

    threads = 0
    kind = "kernel AIO"  # a step's reads in flight at once (io_submit), no reader threads

    def __init__(self, calls: tuple[int, int, int, int], libc) -> None:
        self._setup, self._destroy, self._getevents, self._submit = calls
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long  # long syscall(long number, ...)
        self._ctx = ctypes.c_ulong(0)
        if self._call(self._setup, _DEPTH, ctypes.byref(self._ctx)) < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        self._flight: dict[int, _Read] = {}  # id -> read submitted and not yet reaped
        self._free: dict[int, list[np.ndarray]] = {}  # bounce buffers by size
        self._arena = np.empty(0, np.uint8)           # what is left of the last map to carve them from
        self._events = (_Event * _DEPTH)()
        self._next = 0
        self._lock = threading.Lock()  # one caller at a time reaps and submits

    def _call(self, number: int, *args) -> int:
        # plain ints go as C longs: the call is variadic and the kernel reads whole registers
        return self._syscall(ctypes.c_long(number), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))

    # -- ReadPool's interface --------------------------------------------------------
    def submit(self, jobs: list[tuple], started=None) -> list[_Read]:
        """Start ``(file, dst, offset, what[, put[, nbytes]])`` reads; returns their handles for
        ``collect``. A read whose ``dst`` is None (``nbytes`` given) lands where ``bind`` names,
        or nowhere (collected, not counted) if nothing is named by then."""
        reads = [_Read(*job) for job in jobs]
        with self._lock:
            for r in reads:
                self._prepare(r)
            pending = list(reads)
            while pending:
                pending = pending[self._enter(pending):]
        return reads

    @staticmethod
    def bind(read: _Read, dst: np.ndarray, put=None) -> None:
        """Name where a read started without a destination lands (before it is collected)."""
        if dst.nbytes != read.nbytes:
            raise ValueError(f"a read of {read.nbytes} bytes ({read.what}) bound to {dst.nbytes} bytes")
        read.dst, read.put = dst, put

    def poll(self) -> None:
        """Mark the reads the kernel has finished as done, without waiting (``collect`` lands them)."""
        with self._lock:
            if self._flight:
                self._reap(0)

    def settle(self, started, count: int, timeout: float = 0.01) -> None:
        """Nothing to wait for: every read is in the kernel once ``submit`` returns."""

    def collect(self, reads: list[_Read], t0: float) -> ReadCounters:
        """Wait for ``reads``, land each payload in its destination as it completes; their counters
        summed, ``seconds`` the wall time since ``t0``. Every read completes before an error is
        raised (the first), so no bounce buffer is reused while the kernel writes it."""
        total, error = ReadCounters(), None
        left = [r for r in reads if r.buf is not None]
        with self._lock:
            while left:
                if not any(r.done() for r in left):
                    self._reap(1)
                for r in [r for r in left if r.done()]:
                    left.remove(r)
                    try:
                        total.add(self._land(r))
                    except OSError as err:
                        error = error or err
        if error is not None:
            raise error
        total.seconds = time.perf_counter() - t0
        return total

    def read(self, jobs: list[tuple]) -> ReadCounters:
        t0 = time.perf_counter()
        return self.collect(self.submit(jobs), t0)

    def close(self) -> None:
        if self._ctx.value:
            with self._lock:
                while self._flight:  # the kernel still writes into buffers of these
                    self._reap(1)
                self._call(self._destroy, self._ctx)
                self._ctx.value = 0

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: the context goes with the process)
            pass

    # -- inside -------------------------------------------------------------------------
    def _prepare(self, r: _Read) -> None:
        n = r.nbytes
        r.start = r.offset - r.offset % ALIGN
        size = -(-(r.offset + n) // ALIGN) * ALIGN - r.start
        r.buf = self._buffer(size)
        cb = r.iocb = _Iocb()
        cb.data, cb.opcode, cb.fd = self._next, _PREAD, r.file.fd
        cb.buf, cb.nbytes, cb.offset = r.buf.ctypes.data, size, r.start
        self._flight[self._next] = r
        self._next += 1

    def _enter(self, reads: list[_Read]) -> int:
        """``io_submit`` as many of ``reads`` as the kernel takes (reaping first when it is full)."""
        n = min(len(reads), _DEPTH)
        ptrs = (ctypes.POINTER(_Iocb) * n)(*(ctypes.pointer(r.iocb) for r in reads[:n]))
        now = time.perf_counter()
        for r in reads[:n]:
            r.t0 = now
        got = self._call(self._submit, self._ctx, n, ptrs)
        if got > 0:
            return got
        err = ctypes.get_errno()
        if got < 0 and err in (errno.EAGAIN, errno.EINTR) and (err == errno.EINTR or self._reaped(1)):
            return 0
        r = reads[0]  # refused outright (EBADF, EINVAL, ...): as a read error of the first range
        r.res = -err if got < 0 else -errno.EIO
        del self._flight[r.iocb.data]
        return 1

    def _reaped(self, least: int) -> bool:
        """Reap at least ``least`` completions if any read is in flight; whether one was."""
        if not self._flight:
            return False
        self._reap(least)
        return True

    def _reap(self, least: int) -> None:
        got = -1
        while got < 0:
            got = self._call(self._getevents, self._ctx, least, _DEPTH, self._events, None)
            if got < 0 and ctypes.get_errno() != errno.EINTR:
                raise OSError(ctypes.get_errno(), f"io_getevents: {os.strerror(ctypes.get_errno())}")
        now = time.perf_counter()
        for ev in self._events[:got]:
            r = self._flight.pop(ev.data)
            r.res, r.seconds = ev.res, now - r.t0

    def _land(self, r: _Read) -> ReadCounters:
        """The read's payload into its destination; its counters (or the file's error)."""
        buf, r.buf = r.buf, None
        try:
            n = r.nbytes
            if r.dst is None:  # never bound: nothing wanted it
                return ReadCounters()
            if r.res < 0:
                raise r.file.failed(-r.res, r.what, n, r.offset)
            r.file.land(buf[:r.res], r.start, r.offset, r.dst, r.what, r.put)
            return ReadCounters(1, n, buf.nbytes, r.seconds)
        finally:
            self._free.setdefault(buf.nbytes, []).append(buf)

    def _buffer(self, size: int) -> np.ndarray:
        """A page-aligned bounce buffer of ``size`` bytes: a freed one, else carved from a map."""
        free = self._free.get(size)
        if free:
            return free.pop()
        if self._arena.nbytes < size:
            self._arena = huge_map(max(_CHUNK, size))
        buf, self._arena = self._arena[:size], self._arena[-(-size // ALIGN) * ALIGN:]
        return buf  # a view: keeps its map alive


def open_aio(files) -> tuple[AioPool | None, str]:
    """An ``AioPool`` for reading ``files`` (``DirectFile``s), or None and why not."""
    if not all(f.direct for f in files):
        return None, "kernel AIO only with O_DIRECT"
    calls = _SYSCALLS.get(platform.machine())
    if not sys.platform.startswith("linux") or calls is None or sys.byteorder != "little":
        return None, f"no kernel AIO on {sys.platform} {platform.machine()}"
    if os.environ.get("EXPERTCACHE_AIO", "1") == "0":
        return None, "kernel AIO turned off (EXPERTCACHE_AIO=0)"
    try:
        return AioPool(calls, ctypes.CDLL(None, use_errno=True)), ""
    except OSError as err:  # ENOSYS (no AIO in this kernel), EPERM (seccomp), EAGAIN (fs.aio-max-nr)
        return None, f"io_setup refused ({err.strerror})"
