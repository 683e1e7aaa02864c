"""ggml's own CPU matmul kernels on quantized expert bytes, through ctypes (torch-free).

The kernels are the ones llama.cpp runs (``ggml_mul_mat_id``): they compute on the
quantized blocks, quantizing the activations to the type's vec_dot type (Q8_0, Q8_K,
...), without ever materialising float weights. The libraries come from the PyPI
package ``libggml-python`` (prebuilt ggml, no Python API): the extra
``expertcache[ggml]``. Without it ``available()`` says why and callers keep the torch
path (dequantize, then matmul).

No copies: a ggml tensor of a weight points at bytes the caller owns (a slot pool or
the host's file view), the activations and outputs at the caller's float32 buffers.
Every pointer is a plain ``int``; the runtime passes ``tensor.data_ptr()``. ggml's
``ne[0]`` is the inner (input) dimension, so a ``[rows, cols]`` weight is ``ne = (cols,
rows)``. ggml aborts the process on a failed assertion, so every shape is checked here
before a graph is built.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import lru_cache
from pathlib import Path

GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26
_MAX_DIMS, _MAX_SRC, _MAX_OP_PARAMS, _MAX_NAME = 4, 10, 64, 64
INSTALL_HINT = "pip install 'expertcache[ggml]'"


class _Tensor(ctypes.Structure):
    """``struct ggml_tensor`` (ggml.h, libggml-python 0.20.2): only ``data`` and ``nb`` are written."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * _MAX_DIMS), ("nb", ctypes.c_size_t * _MAX_DIMS),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * (_MAX_OP_PARAMS // 4)),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * _MAX_SRC),
                ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
                ("data", ctypes.c_void_p), ("name", ctypes.c_char * _MAX_NAME),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]


class _TypeTraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


class _ThreadpoolParams(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


LIB_ENV = "EXPERTCACHE_GGML_LIB"  # a folder holding libggml-base.so and libggml-cpu.so


def _lib_dir() -> Path | None:
    """Where the libraries are: ``$EXPERTCACHE_GGML_LIB`` (a native build, e.g. llama.cpp's
    build/bin, whose CPU backend is compiled for this machine), else libggml-python's."""
    if os.environ.get(LIB_ENV):
        return Path(os.environ[LIB_ENV])
    spec = importlib.util.find_spec("libggml")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    return next((root / d for d in ("lib64", "lib") if (root / d / "libggml-cpu.so").exists()), None)


def _declare(base: ctypes.CDLL, cpu: ctypes.CDLL) -> None:
    P, T = ctypes.c_void_p, ctypes.POINTER(_Tensor)
    sigs = [(base, "ggml_init", P, [_InitParams]), (base, "ggml_free", None, [P]),
            (base, "ggml_new_tensor_3d", T, [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
            (base, "ggml_new_tensor_2d", T, [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
            (base, "ggml_new_tensor_1d", T, [P, ctypes.c_int, ctypes.c_int64]),
            (base, "ggml_mul_mat_id", T, [P, T, T, T]), (base, "ggml_mul_mat", T, [P, T, T]),
            (base, "ggml_silu", T, [P, T]), (base, "ggml_mul", T, [P, T, T]),
            (base, "ggml_get_rows", T, [P, T, T]),
            (base, "ggml_new_graph", P, [P]), (base, "ggml_build_forward_expand", None, [P, T]),
            (base, "ggml_tensor_overhead", ctypes.c_size_t, []),
            (base, "ggml_graph_overhead", ctypes.c_size_t, []),
            (base, "ggml_blck_size", ctypes.c_int64, [ctypes.c_int]),
            (base, "ggml_type_size", ctypes.c_size_t, [ctypes.c_int]),
            (base, "ggml_threadpool_params_default", _ThreadpoolParams, [ctypes.c_int]),
            (cpu, "ggml_cpu_init", None, []),
            (cpu, "ggml_get_type_traits_cpu", ctypes.POINTER(_TypeTraitsCpu), [ctypes.c_int]),
            (cpu, "ggml_graph_plan", _CPlan, [P, ctypes.c_int, P]),
            (cpu, "ggml_graph_compute", ctypes.c_int, [P, ctypes.POINTER(_CPlan)]),
            (cpu, "ggml_threadpool_new", P, [ctypes.POINTER(_ThreadpoolParams)]),
            (cpu, "ggml_threadpool_free", None, [P])]
    for lib, name, restype, argtypes in sigs:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


@lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(the CPU library with both libraries' functions declared, or None; why not)."""
    if os.environ.get("EXPERTCACHE_NO_GGML"):  # lets a run (and the tests) see the fallback
        return None, "EXPERTCACHE_NO_GGML is set"
    where = _lib_dir()
    if where is None:
        return None, f"libggml-python is not installed ({INSTALL_HINT})"
    name = f"ggml from {where} (${LIB_ENV})" if os.environ.get(LIB_ENV) else "libggml-python"
    try:
        # base first and global: the CPU backend resolves its symbols against it
        base = ctypes.CDLL(str(where / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(where / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        _declare(base, cpu)
    except (OSError, AttributeError) as err:
        return None, f"{name}: the libraries did not load ({err})"
    cpu.ggml_cpu_init()  # fp16 tables: needed before any kernel runs
    _LIBS[:] = [base, cpu]
    return cpu, name


_LIBS: list[ctypes.CDLL] = []  # [base, cpu] once loaded


def available() -> tuple[bool, str]:
    """(whether ggml's kernels can run here, the library or why not)."""
    lib, why = _load()
    return lib is not None, why


def has_kernel(ggml_type: int) -> bool:
    """Whether ggml's CPU backend has a dot product for weights of this type."""
    if _load()[0] is None:
        return False
    base, cpu = _LIBS
    traits = cpu.ggml_get_type_traits_cpu(ggml_type)
    return bool(traits) and bool(traits.contents.vec_dot) and base.ggml_blck_size(ggml_type) > 0


@lru_cache(maxsize=8)
def _threadpool(n_threads: int, poll: int = 0) -> int | None:
    """One persistent pool per thread count (a per-call pool costs a thread start per worker).

    ``poll`` 0: workers sleep as soon as a graph is done instead of spinning (ggml's default
    50): between graphs torch runs, and on 2 cores a spinning worker starves it (resident
    decode, 2 threads, the lm_head on a pool of 2: 44-414 ms per token with poll 0, 562-624
    with 50). A caller running graphs back to back with little Python between them (the RAM
    tier's segments, runtime/ggmltier.py) asks for a pool of its own that polls."""
    if n_threads <= 1:
        return None
    base, cpu = _LIBS
    params = base.ggml_threadpool_params_default(n_threads)
    params.poll = poll
    return cpu.ggml_threadpool_new(ctypes.byref(params))


class Weight:
    """One stacked weight: ``n`` matrices ``[rows, cols]`` of ``ggml_type``, ``stride`` bytes apart;
    ``packed``: their bytes are in ggml's repacked layout (a ``ggmlrepack.RowRepack`` of that
    shape: the RAM tier's rows under the graph decode), read by the repacked kernels."""

    __slots__ = ("ggml_type", "rows", "cols", "n", "stride", "packed")

    def __init__(self, ggml_type: int, rows: int, cols: int, n: int, stride: int, packed=None) -> None:
        self.ggml_type, self.rows, self.cols, self.n, self.stride = ggml_type, rows, cols, n, stride
        self.packed = packed


class _Graph:
    """One ggml graph, built once in a no-alloc context (ggml holds only the tensors'
    headers) and run many times with new data pointers."""

    def __init__(self, tensors: int) -> None:
        lib, why = _load()
        if lib is None:
            raise RuntimeError(f"ggml kernels unavailable: {why}")
        base = _LIBS[0]
        size = tensors * base.ggml_tensor_overhead() + base.ggml_graph_overhead() + 1024
        self._ctx = base.ggml_init(_InitParams(size, None, True))
        self._graph = base.ggml_new_graph(self._ctx)

    def _weight(self, w: Weight):
        """A tensor header for stacked weight ``w`` (its data pointer set per run)."""
        t = _LIBS[0].ggml_new_tensor_3d(self._ctx, w.ggml_type, w.cols, w.rows, w.n)  # ne: [cols, rows, n]
        t.contents.nb[2] = w.stride  # a slot may be larger than this layer's expert
        if w.packed is not None:
            w.packed.mark(t)
        return t

    def _plan(self, outs: list, n_threads: int) -> None:
        """Add ``outs`` to the graph and size its work buffer for ``n_threads``."""
        base, cpu = _LIBS
        for out in outs:
            base.ggml_build_forward_expand(self._graph, out)
        self._pool = _threadpool(n_threads)
        self._cplan = cpu.ggml_graph_plan(self._graph, n_threads, self._pool)
        self._work = ctypes.create_string_buffer(max(self._cplan.work_size, 1))
        self._cplan.work_data = ctypes.addressof(self._work)
        self._compute = cpu.ggml_graph_compute

    def _run(self) -> None:
        status = self._compute(self._graph, ctypes.byref(self._cplan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def __del__(self) -> None:
        if getattr(self, "_ctx", None) and _LIBS:
            _LIBS[0].ggml_free(self._ctx)
            self._ctx = None


class MatmulId(_Graph):
    """``out_j[t, k] = W_j[ids[t, k]] @ x[t, k or 0]`` for tokens t < T, K experts each, and
    weights j sharing one input.

    Run with new pointers each time: ids int32 ``[T, K]``, x float32 ``[T, K, cols]``
    (``x_per_expert``) or ``[T, cols]`` (each token's row read by its K experts, as
    llama.cpp's first expert matmul does: no gathered copy), each ``out_j`` float32
    ``[T, K, rows_j]``, each weight's bytes ``[n, stride]``. ``used`` = 1 is one expert
    per row: pairs gathered by the caller.
    """

    def __init__(self, weights: list[Weight], pairs: int, n_threads: int, used: int = 1,
                 x_per_expert: bool = False) -> None:
        super().__init__(2 + 2 * len(weights))
        base = _LIBS[0]
        cols = weights[0].cols
        for w in weights:
            _check(base, w, cols)
        x_rows = used if x_per_expert else 1
        self.x = base.ggml_new_tensor_3d(self._ctx, GGML_TYPE_F32, cols, x_rows, pairs)  # ne: [cols, 1|K, T]
        self.ids = base.ggml_new_tensor_2d(self._ctx, GGML_TYPE_I32, used, pairs)        # ne: [K, T]
        self.w = [self._weight(w) for w in weights]
        self.out = [base.ggml_mul_mat_id(self._ctx, t, self.x, self.ids) for t in self.w]  # ne: [rows, K, T]
        self._plan(self.out, n_threads)

    def __call__(self, weights: list[int], x: int, ids: int, outs: list[int]) -> None:
        """Run with these pointers (caller-owned, alive for the call, shaped as the graph says)."""
        for t, ptr in zip(self.w, weights):
            t.contents.data = ptr
        for t, ptr in zip(self.out, outs):
            t.contents.data = ptr
        self.x.contents.data, self.ids.contents.data = x, ids
        self._run()


class SiluMlpId(_Graph):
    """A SiLU-gated expert MLP in one graph, as llama.cpp's ``build_moe_ffn`` runs it:
    ``out[t, k] = D[e] @ (silu(G[e] @ x[t]) * (U[e] @ x[t]))`` with ``e = ids[t, k]``, so ggml's
    pool wakes once a layer and no torch op runs between the matmuls.

    Run with new pointers: x float32 ``[T, cols]``, ids int32 ``[T, K]``, out float32
    ``[T, K, down.rows]``, each weight's bytes ``[n, stride]``. The intermediates (``[T, K,
    gate.rows]`` floats, four of them) live in buffers the graph owns.
    """

    def __init__(self, gate: Weight, up: Weight, down: Weight, tokens: int, used: int, n_threads: int) -> None:
        super().__init__(9)
        base = _LIBS[0]
        _check(base, gate, gate.cols)
        _check(base, up, gate.cols)
        _check(base, down, gate.rows)
        if up.rows != gate.rows:
            raise ValueError(f"gate and up projections differ in rows ({gate.rows} vs {up.rows})")
        self.x = base.ggml_new_tensor_3d(self._ctx, GGML_TYPE_F32, gate.cols, 1, tokens)  # ne: [cols, 1, T]
        self.ids = base.ggml_new_tensor_2d(self._ctx, GGML_TYPE_I32, used, tokens)        # ne: [K, T]
        self.w = [self._weight(w) for w in (gate, up, down)]
        g = base.ggml_mul_mat_id(self._ctx, self.w[0], self.x, self.ids)              # ne: [I, K, T]
        u = base.ggml_mul_mat_id(self._ctx, self.w[1], self.x, self.ids)              # ne: [I, K, T]
        s = base.ggml_silu(self._ctx, g)
        a = base.ggml_mul(self._ctx, s, u)                                            # ne: [I, K, T]
        self.out = base.ggml_mul_mat_id(self._ctx, self.w[2], a, self.ids)            # ne: [H, K, T]
        # a no-alloc context gives the intermediates no memory: 64-byte aligned buffers of ours
        nbytes = 4 * gate.rows * used * tokens
        self._scratch = [ctypes.create_string_buffer(nbytes + 64) for _ in range(4)]
        for t, buf in zip((g, u, s, a), self._scratch):
            t.contents.data = -(-ctypes.addressof(buf) // 64) * 64
        self._plan([self.out], n_threads)

    def __call__(self, weights: list[int], x: int, ids: int, out: int) -> None:
        """Run with these pointers: the gate, up and down bytes, x, ids, out."""
        for t, ptr in zip(self.w, weights):
            t.contents.data = ptr
        self.x.contents.data, self.ids.contents.data, self.out.contents.data = x, ids, out
        self._run()


class Matmul(_Graph):
    """``out = x @ W.T`` for one weight ``W`` ``[rows, cols]`` (``n`` = 1) and N inputs:
    x float32 ``[N, cols]``, out float32 ``[N, rows]`` (a model's Linear on its stored bytes)."""

    def __init__(self, weight: Weight, tokens: int, n_threads: int) -> None:
        super().__init__(3)
        base = _LIBS[0]
        _check(base, weight, weight.cols)
        self.w = base.ggml_new_tensor_2d(self._ctx, weight.ggml_type, weight.cols, weight.rows)  # ne: [cols, rows]
        self.x = base.ggml_new_tensor_2d(self._ctx, GGML_TYPE_F32, weight.cols, tokens)        # ne: [cols, N]
        self.out = base.ggml_mul_mat(self._ctx, self.w, self.x)                                # ne: [rows, N]
        self._plan([self.out], n_threads)

    def __call__(self, weight: int, x: int, out: int) -> None:
        self.w.contents.data, self.x.contents.data, self.out.contents.data = weight, x, out
        self._run()


class GetRows(_Graph):
    """``out[i] = W[ids[i]]`` as float32 for a weight ``[rows, cols]`` of any type with a
    ggml dequantizer (an embedding looked up on its stored bytes): ids int32 ``[N]``,
    out float32 ``[N, cols]``."""

    def __init__(self, weight: Weight, tokens: int) -> None:
        super().__init__(3)
        base = _LIBS[0]
        _check_rows(base, weight)
        self.w = base.ggml_new_tensor_2d(self._ctx, weight.ggml_type, weight.cols, weight.rows)  # ne: [cols, rows]
        self.ids = base.ggml_new_tensor_1d(self._ctx, GGML_TYPE_I32, tokens)                   # ne: [N]
        self.out = base.ggml_get_rows(self._ctx, self.w, self.ids)                             # ne: [cols, N]
        self._plan([self.out], 1)  # a copy of N rows: one thread

    def __call__(self, weight: int, ids: int, out: int) -> None:
        self.w.contents.data, self.ids.contents.data, self.out.contents.data = weight, ids, out
        self._run()


def _check(base: ctypes.CDLL, w: Weight, cols: int) -> None:
    """The shape checks ggml would abort the process on, as a ValueError."""
    if w.cols != cols:
        raise ValueError(f"weights sharing one input need equal columns, got {w.cols} and {cols}")
    if not has_kernel(w.ggml_type):
        raise ValueError(f"ggml has no CPU kernel for ggml type {w.ggml_type}")
    _check_rows(base, w)


def _check_rows(base: ctypes.CDLL, w: Weight) -> None:
    """Whole blocks per row, and the stride holds the matrix."""
    block = base.ggml_blck_size(w.ggml_type)
    if block <= 0:
        raise ValueError(f"ggml has no block layout for ggml type {w.ggml_type}")
    if w.cols % block:
        raise ValueError(f"ggml type {w.ggml_type} needs rows of a multiple of {block} values, got {w.cols}")
    need = w.rows * w.cols // block * base.ggml_type_size(w.ggml_type)
    if w.stride < need:
        raise ValueError(f"a stride of {w.stride} bytes cannot hold a [{w.rows}, {w.cols}] matrix of {need} bytes")


def choose(choice: str, formats) -> tuple[str, str]:
    """('ggml' or 'torch', why) for experts stored in ``formats`` (QuantFormats of every weight
    part, every layer) under ``CacheConfig.cpu_kernel`` ``choice``.

    One kernel per run: a type without a ggml kernel keeps the whole run on torch, named in
    the reason. Asking for 'ggml' without the library is an error; 'auto' falls back.
    """
    if choice == "torch":
        return "torch", "cpu_kernel='torch' asked for: dequantize, then a torch matmul (exact)"
    ok, why = available()
    if not ok:
        if choice == "ggml":
            raise ValueError(f"cpu_kernel='ggml' needs ggml's CPU kernels: {why}; or use cpu_kernel='torch'")
        return "torch", f"ggml kernels unavailable: {why}"
    missing = sorted({f.name for f in formats if f.ggml_type < 0 or not has_kernel(f.ggml_type)})
    if missing:
        return "torch", f"no ggml CPU kernel for {', '.join(missing)} in {why}: dequantize, then a torch matmul"
    return "ggml", f"ggml's quantized CPU kernels ({why}) on the stored bytes"
