"""``planner="device"`` in our transformers runtime: decode steps on the device, the policy a
forward behind on the host.

``DevicePlanner`` joins the engine-agnostic step (``runtime/devicestep.py``) and the
host-side ``expertcache.lagged.LaggedTable``:

- the model's forward pre-hook (``begin_forward``) reads the previous device forward's
  routing (host memory by then), hands it to the lagged table, takes back the slot changes
  decided so far and applies them, then decides whether this forward runs on the device:
  decode (one new token per sequence) whose ``T x K`` pairs fit the staging rows.
  Otherwise (prefill, or a batch wider than the staging rows) the host path of
  ``runtime/experts.py`` runs, planned at once (lag 0) through ``host_step``, after every
  pending decision is applied;
- on the device path each MoE layer's step is ``DeviceStep.run`` with ``slots_kernel``: no
  host read, no data-dependent shape, so the block compiles with ``fullgraph=True``.

Plain slots (float experts), dequantized slots (a GGUF's experts cross as their bytes and
are dequantized on the device as they are staged or loaded) and quantized slots (the step's
rows dequantized into a scratch inside the step) with miss path ``fetch`` take the device
path; other configurations keep the host planner (``planner_reason`` says why).
"""

from __future__ import annotations

import torch

from ..lagged import LaggedTable
from ..stats import DECODE, Stats
from . import compute
from .compute import _activate, fast_grouped_mm, slot_counts
from .devicestep import DeviceStep, LaggedDriver
from .fused import Layout, fused_experts, layout_for


def settings_refusal(cache) -> str | None:
    """Why ``cache``'s settings rule the device planner out (before the pool exists), or None."""
    if cache.host_resident:
        return "every expert is computed on the host's bytes (resident, ggml): no slots to plan"
    if cache.direct:
        return "quantized slots on the CPU are computed by ggml in place; the device step's kernel is torch's"
    if cache.miss != "fetch":
        return f"miss path {cache.miss!r} computes misses on the host; the device step fetches them"
    return None


def host_refusal(cache) -> str | None:
    """Why ``cache``'s settings and host experts rule the device planner out (before the pool
    exists: what ``planner='auto'`` decides on), or None."""
    if cache.tier is not None:
        return "host_memory='tiered' reads missing experts from the file, which the device cannot do"
    refusal = settings_refusal(cache)
    if refusal is not None:
        return refusal
    if cache.device.type == "cuda" and not all(t.is_pinned() for h in cache.hosts for t in h.tensors.values()):
        return (f"host experts in {cache.hosts[0].mode!r} memory are not pinned; the device step reads "
                "pinned memory in place (give host_memory='copy')")
    return None


def device_planner_refusal(cache) -> str | None:
    """Why ``cache`` cannot run the device planner, or None when it can."""
    refusal = host_refusal(cache)
    if refusal is not None:
        return refusal
    pool = cache.pool
    if pool.staging == 0 and pool.slots != cache.num_layers * cache.num_experts:
        return "the pool has no staging rows and not every expert has a slot"
    if pool.staging and pool.staging < cache.staging_blocks:
        return (f"staging_blocks={cache.staging_blocks} needs as many staging rows; the pool "
                f"has {pool.staging}")
    return None


class DevicePlanner(LaggedDriver):
    """The device step and the lagged table of one ``ExpertCache`` (``cache.planner``)."""

    def __init__(self, cache, lag: int, blocks: int = 1, max_tokens: int = 256) -> None:
        pool = cache.pool
        self.cache = cache
        decoders = [h.codec.decode for h in cache.hosts] if cache.slot_format == "dequantized" else None
        step = DeviceStep(pool.tensors, [h.tensors for h in cache.hosts], pool.slots, top_k=cache.top_k,
                          max_tokens=max_tokens, blocks=blocks, resident=cache.table.resident(),
                          decoders=decoders)
        super().__init__(step, LaggedTable(cache.table, lag, pool.staging, blocks))
        self.active = False  # whether the current forward runs on the device
        self.transposed = cache.hosts[0].transposed

    def begin_forward(self, tokens: int | None, phase: int | None) -> None:
        """Before a forward of ``tokens`` new tokens in all (batch x new tokens)."""
        self.active = self.begin(tokens, phase == DECODE)

    def before_apply(self, device: bool) -> None:
        pool = self.cache.pool
        if pool.cuda:  # the two paths share the pool: order their streams at the switch
            if device:
                pool.ready()  # device steps read slots the host path loaded on its copy stream
            else:  # host-path loads (copy stream) must not overwrite rows device steps still read
                pool.copy_stream.wait_stream(torch.cuda.current_stream(pool.device))

    # -- the device step ------------------------------------------------------------------------
    def run(self, layer: int, module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer's step on the device (``DeviceStep.run``); no host read."""
        if self.cache.slot_format == "quantized":
            return self._run_quantized(layer, module, hidden, top_k_index, top_k_weights)
        kernel = slots_kernel(module, self.step.pool, self.transposed)
        return self.step.run(layer, hidden, top_k_weights, top_k_index, kernel)

    def _run_quantized(self, layer, module, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        """Quantized slots: the step's T x K pool rows dequantized into a scratch of N = T x K
        rows, then the kernel over the scratch (fixed shapes, no host read). Interim, until a
        kernel reads the quantized rows itself (issue 31): an expert picked by two tokens is
        dequantized twice."""
        # T tokens, K top-k, N = T*K pairs
        step, codec = self.step, self.cache.hosts[layer].codec
        rows, staged = step.remap(layer, top_k_index)                       # [T, K] pool rows
        step.stage(layer, staged)
        step.record(layer, top_k_index)
        fused = self.cache.pool.fused_layout(module, self.cache.hosts[layer])
        if fused is not None:  # the fused kernel reads the quantized rows in place: no scratch
            return fused_experts(hidden, top_k_weights, rows, fused)
        flat = rows.reshape(-1).long()                                       # [N]
        size = codec.part  # this layer's bytes per part: a prefix of each (largest-sized) row
        scratch = codec.decode({k: t.index_select(0, flat)[:, :size[k].nbytes] for k, t in step.pool.items()})
        local = torch.arange(flat.shape[0], device=flat.device).view(rows.shape)  # [T, K] scratch rows
        return slots_kernel(module, scratch, False)(hidden, top_k_weights, local)

    # -- counters -------------------------------------------------------------------------------
    def stats(self) -> Stats:
        self.observe()
        return self.lagged.stats()

    def h2d(self, expert_bytes: int) -> list[list[int]]:
        """Bytes copied from the host per [phase][layer] on the device path (staged misses and
        loads that found no staging row), in the masked-copy accounting (module doc of
        runtime/devicestep.py: the CPU fallback copies fixed-width rows)."""
        self.observe()
        # each layer's own stored bytes (a GGUF's layers may store different types: Q4_K_M)
        sizes = [getattr(h, "expert_bytes", expert_bytes) for h in self.cache.hosts]
        return [[n * size for n, size in zip(row, sizes)] for row in self.copies]

    def reset_stats(self) -> None:
        self.observe()
        self.lagged.reset_stats()
        self.copies = [[0] * self.step.num_layers for _ in range(2)]


def slots_kernel(module: torch.nn.Module, pool: dict[str, torch.Tensor], transposed: bool):
    """``kernel(x [T, H], weights [T, K], rows [T, K]) -> [T, H]``: every pair on the pool's row;
    fixed shapes, no host read. The fused Triton kernel where it serves (CUDA, float slots of
    SiLU-gated or GPT-OSS experts: ``runtime/fused.py``), whose work follows the pairs; otherwise
    one grouped matmul per projection over all S + R rows (in windows of ``GROUPED_MAX_GROUPS``)."""
    layout = layout_for(module, pool, None, transposed)
    if isinstance(layout, Layout):
        return lambda x, weights, rows: fused_experts(x, weights, rows, layout)
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"

    def kernel(x: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # T tokens, K top-k, N = T*K pairs, S+R pool rows, H hidden
        w_up, w_down = pool[first], pool["down_proj"]
        T, K = rows.shape
        flat = rows.reshape(-1).long()                                       # [N]
        order, perm = torch.sort(flat, stable=True)                          # [N] pairs by row
        offs = torch.cumsum(slot_counts(order, w_up.shape[0]), 0, dtype=torch.int32)  # [S+R]
        xs = x[perm // K].to(w_up.dtype)                                     # [N, H]
        proj = _mm(xs, w_up, offs, order, transposed)
        if first + "_bias" in pool:
            proj = proj + pool[first + "_bias"][order]
        out = _mm(_activate(module, proj), w_down, offs, order, transposed)
        if "down_proj_bias" in pool:
            out = out + pool["down_proj_bias"][order]
        if getattr(module, "has_post_expert_norm", False):
            out = module.post_expert_norm(out)
        out = out * weights.reshape(-1)[perm].unsqueeze(-1).to(out.dtype)   # [N, H]
        full = out.new_zeros(T * K, out.shape[-1]).index_copy(0, perm, out)  # back in pair order
        return full.view(T, K, -1).sum(dim=1).to(x.dtype)                    # [T, H]

    return kernel


def _mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, order: torch.Tensor,
        transposed: bool) -> torch.Tensor:
    """Row-sorted ``x`` [N, in] times the weights of each pair's row (``order`` [N] rows, sorted;
    ``offs``: group ends over ``w`` [S+R, ...]): one grouped matmul, reading the weights in place
    (CUDA: only where torch has its fast kernel, bf16 on sm90/sm100, ``compute.fast_grouped_mm``;
    elsewhere its grouped matmul is a loop that reads the offsets back, a sync; any dtype on the
    CPU in eager mode). Otherwise (and for float32 traced by torch.compile) a gather of the N rows'
    weights and a batched matmul, fixed shapes too (measured 3x slower in CPU decode: it copies
    the weights). Not yet run on a GPU: a pool past 2^31 weight elements in one grouped call is
    what gpu_check's real-size device rows exercise."""
    w = w if transposed else w.transpose(-2, -1)                          # [S+R, in, out]
    cuda = w.device.type == "cuda"
    # the capability from get_device_properties, which dynamo folds to a constant (it does not
    # fold get_device_capability: the step would not trace whole)
    props = torch.cuda.get_device_properties(w.device) if cuda else None
    if (cuda and fast_grouped_mm("cuda", w.dtype, (props.major, props.minor))) or \
            (not cuda and not torch.compiler.is_compiling()):
        return _grouped_windows(x, w, offs, order)
    return torch.bmm(x.unsqueeze(1), w.index_select(0, order)).squeeze(1)  # [N, out]


def _grouped_windows(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``_mm``'s grouped matmul in windows of at most ``compute.GROUPED_MAX_GROUPS`` pool rows
    (torch's CUDA kernel takes no more: issue 29, defect 1); fixed shapes, no host read.

    Window ``[lo, hi)`` gets the pool's cumulative offsets as they are, so its first group also
    spans the pairs of the rows below ``lo`` (computed with the wrong weights) and the pairs past
    its last offset are left unwritten: each pair keeps the result of its own row's window only
    (``torch.where``, which never reads the rejected values). The windows are few (the pool's rows
    over 1024), each reading only its own rows' weights; the fused kernel (``runtime/fused.py``),
    where Triton runs, is the one whose work follows the pairs alone.
    """
    size, limit = w.shape[0], compute.GROUPED_MAX_GROUPS
    if size <= limit:
        return compute.GROUPED_MM(x, w, offs=offs)
    out = None
    for lo in range(0, size, limit):                                       # static: the pool's size
        part = compute.GROUPED_MM(x, w[lo:lo + limit], offs=offs[lo:lo + limit])   # [N, out]
        mine = ((order >= lo) & (order < lo + limit)).unsqueeze(-1)         # [N, 1]
        out = torch.where(mine, part, out if out is not None else torch.zeros_like(part))
    return out
