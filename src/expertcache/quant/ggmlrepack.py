"""Weights repacked into ggml's CPU "repack" buffer type, as llama.cpp's default does (torch-free).

ggml's CPU backend has faster matmul kernels for some quantized types (Q4_0, Q4_K, Q5_K, Q6_K,
IQ4_NL, MXFP4, ...) when their blocks are interleaved 4 or 8 rows at a time (``repack.cpp``:
AVX2 / NEON GEMV over 8 rows at once). llama.cpp repacks every weight it can into a buffer of
that type at load ("CPU_REPACK", `--repack 0` turns it off); on our 12-layer Q4_K_M model that
is +30% decode speed (docs/cpu.md). A tensor in that buffer is used by ``mul_mat`` /
``mul_mat_id`` like any other: ggml's CPU compute sees the buffer type and calls the repacked
kernel (``ggml_cpu_extra_compute_forward``), so the graph is unchanged.

The buffer type is found through ggml's public registry (``ggml_backend_dev_get_extra_bufts``
of the CPU device, named "CPU_REPACK"). Whether a tensor can be repacked is ggml's decision:
``init_tensor`` sets ``tensor->extra`` to its repack traits, or leaves it NULL (a type or row
count the kernels do not take); such tensors stay where they are.

The repacked copy is anonymous memory the size of the weights; the mapped file's pages of
those weights are then released (``madvise(MADV_DONTNEED)``: a read-only file mapping refaults
them from the page cache if anything reads them again), so the weights are held once.

``RowRepack``: the same layout in memory the caller owns (the RAM tier's rows, whose experts
change as they come and go, runtime/tiered.py): an expert repacked into a row as it is read,
and a graph's leaf over the rows marked as a repacked tensor.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from functools import lru_cache

from . import ggml
from .ggml import _InitParams, _Tensor

REPACK_NAME = b"CPU_REPACK"
_HEADERS = 4096         # tensor headers per context (a context per this many repacked tensors)


def _declare(base, cpu) -> None:
    P, T, S = ctypes.c_void_p, ctypes.POINTER(_Tensor), ctypes.c_size_t
    sigs = [(cpu, "ggml_backend_cpu_reg", P, []),
            (base, "ggml_backend_reg_dev_get", P, [P, S]),
            (base, "ggml_backend_reg_get_proc_address", P, [P, ctypes.c_char_p]),
            (base, "ggml_backend_buft_name", ctypes.c_char_p, [P]),
            (base, "ggml_backend_buft_get_alloc_size", S, [P, T]),
            (base, "ggml_backend_buft_alloc_buffer", P, [P, S]),
            (base, "ggml_backend_buffer_get_base", P, [P]),
            (base, "ggml_backend_buffer_free", None, [P]),
            (base, "ggml_backend_tensor_alloc", ctypes.c_int, [P, T, P]),
            (base, "ggml_backend_tensor_set", None, [T, P, S, S]),
            (base, "ggml_log_set", None, [_LOG, P]), (base, "ggml_nbytes", S, [T]), (base, "ggml_row_size", S, [ctypes.c_int, ctypes.c_int64])]
    for lib, name, restype, argtypes in sigs:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


_LOG = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_DEBUG, _INFO, _CONT = 1, 2, 5   # enum ggml_log_level
_last_level = [0]


@_LOG
def _log(level: int, text: bytes, _user) -> None:
    """ggml's messages from warnings up, to stderr; its debug lines (one per repacked tensor) dropped."""
    if level == _CONT:
        level = _last_level[0]
    _last_level[0] = level
    if level > _INFO:
        sys.stderr.write(text.decode(errors="replace"))


def repack_buffer_type() -> int | None:
    """ggml's CPU_REPACK buffer type, or None (no ggml, or a build without it)."""
    if ggml._load()[0] is None:
        return None
    base, cpu = ggml._LIBS
    _declare(base, cpu)
    base.ggml_log_set(_log, None)
    reg = cpu.ggml_backend_cpu_reg()
    dev = base.ggml_backend_reg_dev_get(reg, 0)
    get = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not reg or not dev or not get:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(get)(dev)
    i = 0
    while bufts and bufts[i]:
        if base.ggml_backend_buft_name(bufts[i]) == REPACK_NAME:
            return bufts[i]
        i += 1
    return None


class Repacked:
    """Repacked copies of weights, alive as long as this object (one per model's graph)."""

    def __init__(self) -> None:
        self.buft = repack_buffer_type()   # declares the functions below when ggml loads
        self.base = ggml._LIBS[0] if ggml._LIBS else None
        self._ctxs: list[int] = []
        self._room = 0
        self._buffers: list[int] = []
        self._made: dict[tuple, object] = {}   # (type, ne, data) -> tensor: each weight once
        self.bytes = 0                          # repacked bytes held
        self.tensors = 0
        self._mapped = None                     # clean file mappings, read at the first repack

    def nbytes(self, ggml_type: int, ne: tuple[int, ...]) -> int:
        """Bytes of a contiguous weight of this type and shape (ne innermost first)."""
        rows = ne[1] * (ne[2] if len(ne) > 2 else 1)
        return rows * self.base.ggml_row_size(ggml_type, ne[0])

    def tensor(self, ggml_type: int, ne: tuple[int, ...], data: int, stride: int | None = None):
        """A repacked copy of the weight at ``data`` (``ne`` innermost first: 2 dims, or 3 for a
        stack of experts ``stride`` bytes apart), or None where ggml does not repack it."""
        key = (ggml_type, ne, data)
        if key not in self._made:
            self._made[key] = None if self.buft is None else self._make(ggml_type, ne, data, stride)
        return self._made[key]

    def _make(self, ggml_type: int, ne: tuple[int, ...], data: int, stride: int | None):
        b = self.base
        nbytes = self.nbytes(ggml_type, ne)
        if stride is not None and stride * ne[2] != nbytes:  # experts in rows wider than one: not packed
            return None
        t = self._new(ggml_type, ne)
        size = b.ggml_backend_buft_get_alloc_size(self.buft, t)
        buf = b.ggml_backend_buft_alloc_buffer(self.buft, size)
        if not buf:
            raise MemoryError(f"ggml could not allocate {size} bytes for a repacked weight")
        if b.ggml_backend_tensor_alloc(buf, t, b.ggml_backend_buffer_get_base(buf)) != 0 or not t.contents.extra:
            b.ggml_backend_buffer_free(buf)   # no repack traits for this type / shape: stays mapped
            return None
        b.ggml_backend_tensor_set(t, data, 0, nbytes)   # the repack itself
        self._buffers.append(buf)
        self.bytes += size
        self.tensors += 1
        if self._mapped is None:
            self._mapped = clean_file_maps()
        if any(lo <= data and data + nbytes <= hi for lo, hi in self._mapped):
            release(data, nbytes)   # held once: the repacked copy
        return t

    def _new(self, ggml_type: int, ne: tuple[int, ...]):
        b = self.base
        if self._room == 0:
            self._ctxs.append(b.ggml_init(_InitParams(_HEADERS * b.ggml_tensor_overhead(), None, True)))
            self._room = _HEADERS
        self._room -= 1
        ctx = self._ctxs[-1]
        if len(ne) == 2:
            return b.ggml_new_tensor_2d(ctx, ggml_type, *ne)
        return b.ggml_new_tensor_3d(ctx, ggml_type, *ne)

    def __del__(self) -> None:
        if not ggml._LIBS or self.base is not ggml._LIBS[0]:
            return   # the library was reloaded: these handles are gone with the old one
        for buf in self._buffers:
            self.base.ggml_backend_buffer_free(buf)
        for ctx in self._ctxs:
            self.base.ggml_free(ctx)
        self._buffers, self._ctxs = [], []


class RowRepack:
    """Experts of one weight shape (``[rows, cols]`` of ``ggml_type``) repacked into bytes the
    caller owns, and read by ggml's repacked kernels from there.

    ggml decides whether it repacks a shape: a probe tensor of that shape is allocated in a
    CPU_REPACK buffer, whose ``init_tensor`` sets ``extra`` to the repack traits (chosen by type
    and row count alone) or leaves it NULL (``of`` then answers None). The probe then lends its
    buffer and traits to headers over the caller's memory: the buffer's ``set_tensor`` repacks
    into ``tensor->data`` wherever that points, and the CPU backend computes a ``mul_mat_id``
    with the repacked kernel when its weight's buffer is of that type (``extra`` the traits).
    The repack interleaves 8 (or 4) rows block by block, so it cannot run in place: ``pack``
    reads the plain bytes from one place (a read's bounce buffer, a staging row) and writes the
    repacked ones to another. The size is unchanged (an 8-row block group is 8 blocks).
    A stack of experts back to back is the experts' layouts back to back (ggml repacks groups
    of rows in order, and a group never spans two experts when the row count is a multiple of
    the group's), so a leaf ``[cols, rows, n]`` over repacked rows reads each expert right."""

    _made: dict[tuple[int, int, int], RowRepack | None] = {}

    def __init__(self, ggml_type: int, cols: int, rows: int, base, buffer: int, ctx: int, probe) -> None:
        self.ggml_type, self.cols, self.rows = ggml_type, cols, rows
        self._base, self._buffer, self._ctx, self._probe = base, buffer, ctx, probe
        self.extra = probe.contents.extra
        self.nbytes = base.ggml_nbytes(probe)

    @classmethod
    def of(cls, ggml_type: int, cols: int, rows: int) -> RowRepack | None:
        """The repack of ``[rows, cols]`` weights of ``ggml_type``, or None where ggml does not
        repack them (no CPU_REPACK buffer, a type or row count without a repacked kernel). One
        per shape and loaded library: the probe is an expert's bytes."""
        buft = repack_buffer_type()
        key = (id(ggml._LIBS[0]) if ggml._LIBS else 0, ggml_type, cols, rows)
        if key not in cls._made:
            cls._made[key] = None if buft is None else cls._probe_for(buft, ggml_type, cols, rows)
        return cls._made[key]

    @classmethod
    def _probe_for(cls, buft: int, ggml_type: int, cols: int, rows: int) -> RowRepack | None:
        base = ggml._LIBS[0]
        if cols % base.ggml_blck_size(ggml_type):
            return None
        ctx = base.ggml_init(_InitParams(2 * base.ggml_tensor_overhead(), None, True))
        probe = base.ggml_new_tensor_2d(ctx, ggml_type, cols, rows)        # [cols, rows]
        buf = base.ggml_backend_buft_alloc_buffer(buft, base.ggml_backend_buft_get_alloc_size(buft, probe))
        if not buf:
            base.ggml_free(ctx)
            raise MemoryError("ggml could not allocate a repack buffer for one expert")
        if base.ggml_backend_tensor_alloc(buf, probe, base.ggml_backend_buffer_get_base(buf)) != 0 \
                or not probe.contents.extra:
            base.ggml_backend_buffer_free(buf)
            base.ggml_free(ctx)
            return None
        return cls(ggml_type, cols, rows, base, buf, ctx, probe)

    def pack(self, dst: int, src: int) -> None:
        """Repack the expert's plain bytes at ``src`` into ``dst`` (``nbytes`` each, not
        overlapping). Thread-safe (a header of its own; ctypes releases the GIL meanwhile)."""
        header = _Tensor.from_buffer_copy(self._probe.contents)   # the probe's type, shape, buffer, traits
        header.data = dst
        self._base.ggml_backend_tensor_set(ctypes.byref(header), src, 0, self.nbytes)

    def mark(self, leaf) -> None:
        """Make ``leaf`` (a graph's tensor ``[cols, rows, n]`` over repacked experts) read them
        through the repacked kernels."""
        t = leaf.contents
        if t.type != self.ggml_type or t.ne[0] != self.cols or t.ne[1] != self.rows:
            raise ValueError(f"a leaf of type {t.type} [{t.ne[0]}, {t.ne[1]}] over experts repacked as "
                             f"type {self.ggml_type} [{self.cols}, {self.rows}]")
        t.buffer, t.extra = self._buffer, self.extra

    def __del__(self) -> None:
        if ggml._LIBS and self._base is ggml._LIBS[0]:
            self._base.ggml_backend_buffer_free(self._buffer)
            self._base.ggml_free(self._ctx)


def clean_file_maps() -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of files that hold no page of their own
    (``/proc/self/smaps``: ``Anonymous: 0 kB``, no copy-on-write page written): where dropping
    pages loses nothing. On anonymous memory, or a written private page, MADV_DONTNEED would
    zero or revert the bytes."""
    out, current = [], None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    lo, hi = head[0].split("-")
                    current = (int(lo, 16), int(hi, 16)) if len(head) >= 6 and head[5].startswith("/") else None
                elif head[0] == "Anonymous:" and current is not None and head[1] == "0":
                    out.append(current)
    except (OSError, ValueError, IndexError):   # not Linux, or a format not understood: keep the pages
        return []
    return out


def release(addr: int, nbytes: int) -> None:
    """Drop the pages of [addr, addr + nbytes) from this process's memory (whole pages inside the
    range only, so a neighbour's bytes stay mapped). For clean file mappings only (see
    ``clean_file_maps``): the kernel rereads them from the page cache if touched again."""
    page = mmap.PAGESIZE
    start, end = -(-addr // page) * page, (addr + nbytes) // page * page
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED


@lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
