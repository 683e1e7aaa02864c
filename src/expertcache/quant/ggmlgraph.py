"""A whole ggml compute graph from Python: the ops a decoder layer needs, one graph built once
and run many times (torch-free).

``quant/ggml.py`` runs one small graph per call (an expert MLP, a linear); this module builds
the graph of a whole decode step, as llama.cpp does: the caller adds ops through ``Graph``'s
methods (each returns a tensor pointer), marks its outputs, and ``finish()`` lets ggml's graph
allocator (``ggml_gallocr``) place every intermediate in one reused buffer. Tensors whose data
the caller owns (weights on the mapped file, the KV cache, inputs) get their pointer before
any view of them is made, so the allocator leaves them alone ("allocated without
ggml-backend"). A run is one ``ggml_graph_compute`` on ggml's thread pool.
"""

from __future__ import annotations

import ctypes

from . import ggml
from .ggml import GGML_TYPE_F32, GGML_TYPE_I32, _InitParams, _Tensor

GGML_TYPE_F16, GGML_TYPE_I64 = 1, 27
ROPE_NORMAL = 0         # adjacent pairs rotated (DeepSeek's interleaved rotary dims)
ROPE_NEOX = 2           # GGML_ROPE_TYPE_NEOX: rotate halves (transformers' rotate_half)
PREC_F32 = 10           # GGML_PREC_F32
_GRAPH_NODES = 16384    # ggml_new_graph_custom's size: far above a 100-layer decode step

_declared_for = None   # the library handle whose functions carry the declarations below


def _declare() -> None:
    """The extra functions a whole graph needs (``quant/ggml.py`` declares the matmul ones), on
    the handle loaded now: a reload (``ggml._load.cache_clear()``) makes new handles whose
    functions default to int results, and a pointer read as an int crashed the process."""
    global _declared_for
    base, cpu = ggml._LIBS
    if _declared_for is base:
        return
    P, T, F, I, I64 = ctypes.c_void_p, ctypes.POINTER(_Tensor), ctypes.c_float, ctypes.c_int, ctypes.c_int64
    S = ctypes.c_size_t
    sigs = [("ggml_new_graph_custom", P, [P, S, ctypes.c_bool]),
            ("ggml_graph_overhead_custom", S, [S, ctypes.c_bool]),
            ("ggml_set_input", None, [T]), ("ggml_set_output", None, [T]),
            ("ggml_rms_norm", T, [P, T, F]), ("ggml_add", T, [P, T, T]), ("ggml_div", T, [P, T, T]),
            ("ggml_scale", T, [P, T, F]), ("ggml_sigmoid", T, [P, T]), ("ggml_soft_max", T, [P, T]),
            ("ggml_clamp", T, [P, T, F, F]), ("ggml_sum_rows", T, [P, T]), ("ggml_cont", T, [P, T]),
            ("ggml_reshape_2d", T, [P, T, I64, I64]), ("ggml_reshape_3d", T, [P, T, I64, I64, I64]),
            ("ggml_reshape_4d", T, [P, T, I64, I64, I64, I64]),
            ("ggml_view_4d", T, [P, T, I64, I64, I64, I64, S, S, S, S]),
            ("ggml_concat", T, [P, T, T, I]), ("ggml_fill", T, [P, T, F]),
            ("ggml_scale_bias", T, [P, T, F, F]),
            ("ggml_view_2d", T, [P, T, I64, I64, S, S]), ("ggml_view_3d", T, [P, T, I64, I64, I64, S, S, S]),
            ("ggml_permute", T, [P, T, I, I, I, I]),
            ("ggml_rope_ext", T, [P, T, T, T, I, I, I, F, F, F, F, F, F]),
            ("ggml_flash_attn_ext", T, [P, T, T, T, T, F, F, F]),
            ("ggml_flash_attn_ext_set_prec", None, [T, I]),
            ("ggml_argsort_top_k", T, [P, T, I]), ("ggml_set_rows", T, [P, T, T, T]),
            ("ggml_swiglu_split", T, [P, T, T]), ("ggml_swiglu_oai", T, [P, T, T, F, F]),
            ("ggml_add_id", T, [P, T, T, T]), ("ggml_flash_attn_ext_add_sinks", None, [T, T]),
            ("ggml_gallocr_new", P, [P]), ("ggml_gallocr_free", None, [P]),
            ("ggml_gallocr_alloc_graph", ctypes.c_bool, [P, P]),
            ("ggml_gallocr_get_buffer_size", S, [P, I]),
            ("ggml_backend_cpu_buffer_type", P, [])]
    for name, restype, argtypes in sigs:
        fn = getattr(base, name)
        fn.restype, fn.argtypes = restype, argtypes
    _declared_for = base


class Graph:
    """One graph in a no-alloc context: add ops, ``finish(outputs)``, then ``run()`` per token.

    ``tensors`` bounds the tensor headers the context can hold (each op makes one)."""

    def __init__(self, tensors: int = 8192) -> None:
        lib, why = ggml._load()
        if lib is None:
            raise RuntimeError(f"ggml kernels unavailable: {why}")
        _declare()
        self._base, self._cpu = ggml._LIBS
        b = self._base
        size = tensors * b.ggml_tensor_overhead() + b.ggml_graph_overhead_custom(_GRAPH_NODES, False) + 4096
        self.ctx = b.ggml_init(_InitParams(size, None, True))
        # ggml aborts the process when its context is full: count here (2 headers a call at
        # most: argsort_top_k makes a sort and a view) and raise first
        self._room = tensors
        self.graph = b.ggml_new_graph_custom(self.ctx, _GRAPH_NODES, False)
        self._galloc = None
        self._keep: list = []  # buffers whose addresses tensors hold

    # -- leaves ------------------------------------------------------------------
    def leaf(self, ggml_type: int, ne: tuple[int, ...], data: int | None = None, stride: int | None = None):
        """A tensor of 1-3 dims (ne innermost first); ``data``: the caller's pointer (kept alive
        by the caller), else an input the caller fills through ``input_buffer``. ``stride``
        overrides nb[-1] (stacked experts in slots larger than one expert)."""
        b = self._base
        self._use(1)
        if len(ne) == 1:
            t = b.ggml_new_tensor_1d(self.ctx, ggml_type, *ne)
        elif len(ne) == 2:
            t = b.ggml_new_tensor_2d(self.ctx, ggml_type, *ne)
        else:
            t = b.ggml_new_tensor_3d(self.ctx, ggml_type, *ne)
        if stride is not None:
            t.contents.nb[len(ne) - 1] = stride
        if data is not None:
            t.contents.data = data
        return t

    def input(self, ggml_type: int, ne: tuple[int, ...], nbytes_per: int):
        """An input tensor backed by a buffer this graph owns; returns (tensor, address)."""
        count = 1
        for n in ne:
            count *= n
        buf = ctypes.create_string_buffer(count * nbytes_per + 64)
        self._keep.append(buf)
        addr = -(-ctypes.addressof(buf) // 64) * 64
        return self.leaf(ggml_type, ne, addr), addr

    # -- ops (thin: each is one ggml call; shapes checked by the caller's builder) --------
    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        fn = getattr(self._base, "ggml_" + name)

        def op(*args):
            self._use(2)
            return fn(self.ctx, *args)
        return op

    def _use(self, headers: int) -> None:
        self._room -= headers
        if self._room < 0:
            raise RuntimeError("ggml graph context too small for this model (raise Graph's tensors)")

    def rope(self, x, pos, n_dims: int, mode: int, base: float, freq_scale: float = 1.0,
             freq_factors=None, attn_factor: float = 1.0):
        """RoPE without ggml's own YaRN ramp (ext_factor 0): ``freq_factors`` [n_dims / 2] divide
        each pair's frequency, ``attn_factor`` scales cos and sin (transformers' attention_scaling)."""
        self._use(1)
        return self._base.ggml_rope_ext(self.ctx, x, pos, freq_factors, n_dims, mode, 0, base, freq_scale,
                                        0.0, attn_factor, 0.0, 0.0)

    def attention(self, q, k, v, mask, scale: float, sinks=None):
        """Flash attention; ``sinks`` [heads] float32: one more logit a head in the softmax's
        denominator, with no value (GPT-OSS)."""
        self._use(1)
        out = self._base.ggml_flash_attn_ext(self.ctx, q, k, v, mask, scale, 0.0, 0.0)
        self._base.ggml_flash_attn_ext_set_prec(out, PREC_F32)
        if sinks is not None:
            self._base.ggml_flash_attn_ext_add_sinks(out, sinks)
        return out

    def expand(self, t) -> None:
        """Put ``t`` (and what it needs) into the graph now: orders side effects (KV writes)."""
        self._base.ggml_build_forward_expand(self.graph, t)

    # -- build, run ----------------------------------------------------------------
    def finish(self, outputs: list, n_threads: int) -> int:
        """Mark ``outputs`` (never overwritten), allocate the intermediates, plan the threads;
        returns the compute buffer's bytes."""
        b, c = self._base, self._cpu
        for t in outputs:
            b.ggml_set_output(t)
            b.ggml_build_forward_expand(self.graph, t)
        self._galloc = b.ggml_gallocr_new(b.ggml_backend_cpu_buffer_type())
        if not b.ggml_gallocr_alloc_graph(self._galloc, self.graph):
            raise RuntimeError("ggml could not allocate the decode graph's buffers")
        self.compute_bytes = b.ggml_gallocr_get_buffer_size(self._galloc, 0)
        self._pool = ggml._threadpool(n_threads)  # shared with the per-layer graphs: workers sleep at once
        self._cplan = c.ggml_graph_plan(self.graph, n_threads, self._pool)
        self._work = ctypes.create_string_buffer(max(self._cplan.work_size, 1))
        self._cplan.work_data = ctypes.addressof(self._work)
        self._compute = c.ggml_graph_compute
        self._cplan_ref = ctypes.byref(self._cplan)
        return self.compute_bytes + self._cplan.work_size

    def run(self) -> None:
        status = self._compute(self.graph, self._cplan_ref)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def __del__(self) -> None:
        if not ggml._LIBS:
            return
        if getattr(self, "_galloc", None):
            self._base.ggml_gallocr_free(self._galloc)
            self._galloc = None
        if getattr(self, "ctx", None):
            self._base.ggml_free(self.ctx)
            self.ctx = None


def data_of(t) -> int:
    """A tensor's data address (after ``finish``: where an output lives)."""
    return t.contents.data


def view_src(t):
    """The tensor a view looks into."""
    return ctypes.cast(t.contents.view_src, ctypes.POINTER(_Tensor))


def _array(ctype, addr: int, shape: tuple[int, ...]):
    import numpy as np

    count = 1
    for n in shape:
        count *= n
    return np.ctypeslib.as_array((ctype * count).from_address(addr)).reshape(shape)


def int32_array(t_or_addr, shape: tuple[int, ...]):
    """A numpy view of int32 memory (a tensor's data or an address)."""
    addr = t_or_addr if isinstance(t_or_addr, int) else data_of(t_or_addr)
    return _array(ctypes.c_int32, addr, shape)


def int64_array(addr: int, shape: tuple[int, ...]):
    return _array(ctypes.c_int64, addr, shape)


def f16_array(addr: int, shape: tuple[int, ...]):
    return _array(ctypes.c_uint16, addr, shape).view("<f2")


def nb(t, i: int) -> int:
    return t.contents.nb[i]


def ne(t) -> tuple[int, int, int, int]:
    return tuple(t.contents.ne)


__all__ = ["Graph", "data_of", "nb", "ne", "GGML_TYPE_F32", "GGML_TYPE_F16", "GGML_TYPE_I32",
           "GGML_TYPE_I64", "ROPE_NEOX", "ROPE_NORMAL"]
