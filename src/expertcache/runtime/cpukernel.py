"""Experts computed by ggml's quantized kernels straight from their stored bytes.

Wherever quantized experts are computed on the CPU (the ``cpu`` miss path, baseline
``cpu``, slots on a CPU device, or a resident run reading the host bytes in place) and
the run's ``cpu_kernel`` resolved to 'ggml' (``quant.ggml.choose``), a step's
(token, rank) pairs go through ``ggml_mul_mat_id`` on the bytes: no dequantization, no
float copy of any expert. The activation between the two matmuls (the module's own
``_apply_gate`` / ``act_fn``), biases and the routing weights stay in torch, so every
family computes as its eager code does.
"""

from __future__ import annotations

import torch

from ..quant import ggml
from ..quant.dequant import dequantize
from .compute import _activate
from .quantized import Codec, Kind, _join
from .threads import ggml_threads

# Graphs for at most this many pairs are kept (decode steps: top-k of them, a handful of
# sizes); bigger ones (prefill) are built per call, which costs microseconds next to them.
_CACHED_PAIRS = 64


class GgmlExperts:
    """One layer's codec run by ggml: ``forward`` computes pairs from any ``[n, stride]`` byte
    tensors holding that layer's parts (the host's experts, or the slot pool's)."""

    def __init__(self, codec: Codec) -> None:
        self.codec, self.part = codec, codec.part
        weights = [k for k in codec.kinds if len(self.part[k.parts[0]].shape) == 2]
        self.first, self.down = weights[0], next(k for k in weights if k.name == "down_proj")
        biases = {k.name: k for k in codec.kinds if k not in weights}
        self.first_bias = biases.get(self.first.name + "_bias")
        self.down_bias = biases.get("down_proj_bias")
        self._graphs: dict[tuple, ggml.MatmulId | ggml.SiluMlpId] = {}
        self._fusable: bool | None = None  # SiluMlpId fits the module (_silu_gate), once known
        # every step on ggml's threads: in decode torch is down to one (runtime/threads.py)
        self.threads = ggml_threads()
        self.packed: dict = {}  # part -> ggmlrepack.RowRepack: the bytes it reads are repacked

    def read_repacked(self, packed: dict) -> None:
        """Read ``packed``'s parts (part -> ``ggmlrepack.RowRepack``) as ggml's repacked layout
        from now on: every byte tensor this layer computes from holds them so (the RAM tier's
        rows under the graph decode, runtime/ggmltier.py)."""
        biases = {p for k in (self.first_bias, self.down_bias) if k is not None for p in k.parts}
        if biases & set(packed):
            raise ValueError("expert biases are dequantized from the bytes in torch: they cannot be repacked")
        self.packed = dict(packed)
        self._graphs.clear()  # built over the other layout

    def forward(self, module: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor,
                tensors: dict[str, torch.Tensor], used: int = 1) -> torch.Tensor:
        """Experts' outputs for their pairs: ids int32 rows of ``tensors`` (part -> [n, stride]
        uint8), [N] (one expert per row of x [N, H]) or [T, used] (x [T, H], each token's row
        read by its ``used`` experts: no gathered copy). x any float dtype. Returns
        [N or T*used, H] float32."""
        x = x.float().contiguous()
        flat = ids.reshape(-1)                                                        # [P] pairs
        proj = _join(self.first, self._matmul(self.first.parts, x, ids, tensors, used))  # [P, 2I]
        if self.first_bias is not None:
            proj = proj + self._bias(self.first_bias, flat, tensors)
        act = _activate(module, proj).float().contiguous()                           # [P, I]
        out = self._matmul(self.down.parts, act, ids, tensors, used, x_per_expert=True)[0]  # [P, H]
        if self.down_bias is not None:
            out = out + self._bias(self.down_bias, flat, tensors)
        if getattr(module, "has_post_expert_norm", False):
            out = module.post_expert_norm(out)
        return out

    def routed(self, module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every (token, rank) pair at once, when each expert id is its own row of ``tensors``
        (the host's experts): one ggml graph (``SiluMlpId``) or two, and a weighted sum, no
        per-pair Python. hidden [T, H], top_k_index [T, K], top_k_weights [T, K]; returns [T, H]."""
        T, K = top_k_index.shape
        ids = top_k_index.to(torch.int32).contiguous()                                # [T, K]
        if self._silu_gate(module):  # the whole MLP in one graph, as llama.cpp runs it
            out = self._silu_mlp(hidden, ids, tensors)                                # [T*K, H]
        else:
            out = self.forward(module, hidden, ids, tensors, used=K)                  # [T*K, H]
        w = top_k_weights.to(out.dtype).unsqueeze(1)                                 # [T, 1, K]
        return torch.bmm(w, out.view(T, K, -1)).squeeze(1).to(hidden.dtype)          # [T, H]

    def _silu_gate(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` computes ``silu(gate) * up`` from separate gate and up weights, with
        no biases and nothing after down: what ``SiluMlpId`` computes (decided once a layer)."""
        if self._fusable is None:
            from transformers.activations import SiLUActivation
            from transformers.integrations import moe

            # a private name (pinned by a test): where a transformers release lacks it, the layer
            # keeps the two-graph path, which is exact for every gate
            default_gate = getattr(moe, "_default_apply_gate", None)
            self._fusable = (self.first.join == "concat" and len(self.first.parts) == 2
                             and self.first_bias is None and self.down_bias is None
                             and default_gate is not None
                             and getattr(type(module), "_apply_gate", None) is default_gate
                             and getattr(module, "has_gate", True)
                             and not getattr(module, "has_post_expert_norm", False)
                             and type(getattr(module, "act_fn", None)) in (SiLUActivation, torch.nn.SiLU))
        return self._fusable

    def _silu_mlp(self, hidden: torch.Tensor, ids: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """hidden [T, H], ids int32 [T, K] -> [T*K, H] float32: ``SiluMlpId`` over rows of ``tensors``."""
        (T, K), parts = ids.shape, (*self.first.parts, *self.down.parts)  # gate, up (concat order), down
        key = ("silu", T, K, *(tuple(tensors[p].shape) for p in parts))
        graph = self._graph(key, T * K, lambda: ggml.SiluMlpId(*self._weights(parts, tensors), T, K, self.threads))
        x = hidden.float().contiguous()
        out = torch.empty(T * K, self.part[self.down.parts[0]].shape[0])                # [T*K, H]
        graph([tensors[p].data_ptr() for p in parts], x.data_ptr(), ids.data_ptr(), out.data_ptr())
        return out

    def _matmul(self, parts: tuple[str, ...], x: torch.Tensor, ids: torch.Tensor,
                tensors: dict[str, torch.Tensor], used: int = 1, x_per_expert: bool = False) -> list[torch.Tensor]:
        """[x @ W_p[ids].T for each part p]: one graph, parts sharing the input. ids [T, used]
        (or [N] with used = 1); x [T, H], or [T*used, H] with ``x_per_expert``."""
        n = ids.numel() // used                                                       # T
        key = (parts, n, used, x_per_expert, *(tuple(tensors[p].shape) for p in parts))
        graph = self._graph(key, n * used,
                            lambda: ggml.MatmulId(self._weights(parts, tensors), n, self.threads, used, x_per_expert))
        outs = [x.new_empty(n * used, self.part[p].shape[0]) for p in parts]  # [T*used, rows_p] each
        graph([tensors[p].data_ptr() for p in parts], x.data_ptr(), ids.data_ptr(),
              [o.data_ptr() for o in outs])
        return outs

    def _graph(self, key: tuple, pairs: int, build):
        """The graph for ``key``, built by ``build()`` once; kept for decode sizes only."""
        graph = self._graphs.get(key)
        if graph is None:
            graph = build()
            if pairs <= _CACHED_PAIRS:
                self._graphs[key] = graph
        return graph

    def _weights(self, parts: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> list[ggml.Weight]:
        """ggml's view of each part's bytes in ``tensors`` ([n, stride] uint8)."""
        return [ggml.Weight(self.part[p].fmt.ggml_type, *self.part[p].shape, tensors[p].shape[0],
                            tensors[p].stride(0), self.packed.get(p)) for p in parts]

    def _bias(self, kind: Kind, ids: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """[N, rows] biases of the pairs' experts (tiny: dequantized with torch)."""
        rows = ids.long()
        parts = [dequantize(tensors[p].index_select(0, rows)[:, :self.part[p].nbytes], self.part[p].fmt,
                            (len(rows), *self.part[p].shape), torch.float32) for p in kind.parts]
        return _join(kind, parts)


def ggml_experts(kernel: GgmlExperts, module: torch.nn.Module, hidden: torch.Tensor, weights: torch.Tensor,
                 idx_rows: list[list[int]], rows: dict[int, int], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over the pairs whose expert is in ``rows`` (expert -> row of ``tensors``) of the expert's
    output times its routing weight. hidden [T, H], weights [T, K] (host tensors); returns [T, H]."""
    tok, rank, ids = [], [], []
    for t, row in enumerate(idx_rows):
        for k, e in enumerate(row):
            if e in rows:
                tok.append(t)
                rank.append(k)
                ids.append(rows[e])
    out = torch.zeros_like(hidden)
    if not tok:
        return out
    tok_idx = torch.tensor(tok)
    y = kernel.forward(module, hidden.index_select(0, tok_idx), torch.tensor(ids, dtype=torch.int32), tensors)
    y = y * weights[tok_idx, torch.tensor(rank)].unsqueeze(-1).to(y.dtype)   # [N, H]
    return out.index_add_(0, tok_idx, y.to(out.dtype))
