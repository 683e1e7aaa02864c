"""A GGUF's dense weights computed by ggml on their stored bytes, on the CPU.

Without this the loader dequantizes every non-expert tensor to float32: on a Qwen3-MoE
Q4_K_M the token embedding and the lm_head alone become 1.2 GiB, and the float32 lm_head
read 594 MiB per decoded token (docs/cpu.md). With the run's ``cpu_kernel`` resolving to
ggml on a CPU device, each quantized 2-D tensor used as an ``nn.Linear`` (lm_head,
attention projections, shared experts, dense MLPs) becomes a ``GgmlLinear``
(``ggml_mul_mat``) and the token embedding a ``GgmlEmbedding`` (``ggml_get_rows``), both
over a view of the memory-mapped file: no float copy exists. F32 tensors (norms, routers)
and types without a ggml kernel keep the torch path; ``DenseReport`` names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..quant import ggml
from .threads import ggml_threads

# Graphs for at most this many tokens are kept (decode and short prompts); longer ones
# are built per call, which costs microseconds next to them.
_CACHED_TOKENS = 64
# A weight under this many bytes runs a decode step on one ggml thread: waking the pool
# costs more than it saves on attention-sized weights (measured: equal tok/s); bigger ones
# (the lm_head) are read faster by every thread (runtime/threads.py).
_ONE_THREAD_BYTES = 16 << 20
_ONE_THREAD_TOKENS = 16


class _Stored(torch.nn.Module):
    """One ``[rows, cols]`` weight as its stored bytes (``data``: a uint8 view of the file,
    a plain attribute, not a parameter or buffer: ``state_dict`` and ``.to()`` leave it be)."""

    def __init__(self, data: torch.Tensor, ggml_type: int, rows: int, cols: int) -> None:
        super().__init__()
        self.data, self.ggml_type, self.rows, self.cols = data, ggml_type, rows, cols
        self.weight_spec = ggml.Weight(ggml_type, rows, cols, 1, data.numel())
        self.threads = ggml_threads()  # at load: a decode forward narrows torch's count
        self._graphs: dict[int, ggml._Graph] = {}

    def _graph(self, n: int, build):
        graph = self._graphs.get(n)
        if graph is None:
            graph = build(n)
            if n <= _CACHED_TOKENS:
                self._graphs[n] = graph
        return graph


class GgmlLinear(_Stored):
    """``nn.Linear`` on stored bytes: x [..., in] (any float dtype) -> [..., out] in x's dtype."""

    def __init__(self, data: torch.Tensor, ggml_type: int, out_features: int, in_features: int,
                 bias: bool) -> None:
        super().__init__(data, ggml_type, out_features, in_features)
        self.in_features, self.out_features = in_features, out_features
        # filled by the loader's load_state_dict(assign=True), like the Linear's own bias
        self.bias = torch.nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] is read as [N, in] in place when float32 and contiguous (decode: no
        # copies, few torch calls; 25 of these run per token)
        if x.shape[-1] != self.cols:
            raise ValueError(f"input of {x.shape[-1]} features for a linear of {self.cols} ({tuple(x.shape)})")
        flat = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        n = flat.numel() // self.cols
        out = torch.empty(*x.shape[:-1], self.rows)                               # [..., out]
        self._graph(n, self._build)(self.data.data_ptr(), flat.data_ptr(), out.data_ptr())
        if self.bias is not None:
            out += self.bias
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _build(self, n: int) -> ggml.Matmul:
        small = n <= _ONE_THREAD_TOKENS and self.data.numel() < _ONE_THREAD_BYTES
        return ggml.Matmul(self.weight_spec, n, 1 if small else self.threads)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ggml_type={self.ggml_type}"


class GgmlEmbedding(_Stored):
    """``nn.Embedding`` on stored bytes: ids [...] -> [..., dim] in ``dtype`` (rows dequantized
    by ggml as they are looked up)."""

    def __init__(self, data: torch.Tensor, ggml_type: int, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype, padding_idx: int | None = None) -> None:
        super().__init__(data, ggml_type, num_embeddings, embedding_dim)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int32).contiguous()                      # [N]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.rows):
            raise IndexError(f"token id out of range for an embedding of {self.rows} rows")
        out = torch.empty(flat.numel(), self.cols)                                # [N, dim]
        if flat.numel():
            self._graph(flat.numel(), lambda n: ggml.GetRows(self.weight_spec, n))(
                self.data.data_ptr(), flat.data_ptr(), out.data_ptr())
        return out.reshape(*ids.shape, self.cols).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={self.ggml_type}"


@dataclass
class DenseReport:
    """How a model's dense weights compute (``stats().pool['dense_kernel' / '_reason']``)."""

    kernel: str = "torch"
    reason: str = "dense weights are torch tensors"
    ggml: list[str] = field(default_factory=list)          # transformers module names on ggml
    fallback: dict[str, str] = field(default_factory=dict)  # module name -> why it stays torch

    def summary(self) -> str:
        if self.kernel != "ggml":
            return self.reason
        text = f"{self.reason}: {len(self.ggml)} modules on ggml (no float copy)"
        if self.fallback:
            why = sorted(set(self.fallback.values()))
            text += f"; {len(self.fallback)} stay torch ({'; '.join(why)})"
        return text


REPORT_ATTR = "_expertcache_dense"  # where the loader leaves the DenseReport on the model


def report_of(model: torch.nn.Module | None) -> DenseReport:
    return getattr(model, REPORT_ATTR, None) or DenseReport()
