"""The step on the device: slot lookup, staging of misses, id remap and one kernel call.

Engine-agnostic (our transformers runtime and the vLLM plug-in use it alike): it knows
a pool of weight tensors ``[S + R, ...]`` (S cache slots, then R staging rows), each
layer's host store ``[E, ...]`` under the same names, and a kernel
``kernel(x, weights, slot_ids) -> [T, H]`` that reads the pool by row id (ids run up to
S + R - 1: a kernel that takes an expert count must be given S + R). Nothing in a step reads
a tensor back to the host or branches on a tensor's value, and on CUDA and when traced no
shape depends on data, so a step can run inside a CUDA graph or
``torch.compile(fullgraph=True)`` (the CPU in eager mode compacts its staging copy, below).

API (stable; the vLLM plug-in builds on it)::

    step = DeviceStep(pool={"w13": w13 [S+R, 2I, H], "w2": w2 [S+R, H, I]},
                      hosts=[{"w13": [E, 2I, H], "w2": [E, H, I]} per layer],  # pinned on CUDA
                      slots=S, max_tokens=256, top_k=K,
                      blocks=1)  # R staging rows in blocks; layer l stages into block l % blocks
    step.slot_map                 # int32 [L, E] on the pool's device: expert -> slot, or -1
    step.fits(T)                  # shape-only: min(T*K, E) <= R // blocks: every miss gets a row
    out = step.run(layer, x, topk_weights, topk_ids, kernel)   # remap + stage + kernel once;
                                  # records the ids [T, K] for the host (``routing``)
    slot_ids, staged = step.remap(layer, topk_ids)   # the pure parts of run(), for callers that
    step.stage(layer, staged)                        # call their kernel themselves
    step.record(layer, topk_ids)                     # non-blocking copy into pinned memory
    ids = step.routing(layer, T)  # host view [T, K] of what the last forward recorded (after
                                  # step.routed_event, if any, has completed)
    step.write_map(entries)       # [(layer, expert, slot or -1)]: map only (host-filled slots)
    step.apply(updates)           # host-issued slot changes: [(layer, expert, slot or -1,
                                  # staging row or -1)], before a forward (lagged.Update)
    step.apply_fixed(buffers)     # the same from fixed-size buffers (graph-safe)

    driver = LaggedDriver(step, LaggedTable(table, lag, staging=R))  # the host side, per forward:
    device = driver.begin(T, decode)   # observe the last forward, apply due decisions; True:
                                       # run this forward's layers with step.run
    plan = driver.host_step(layer, experts, phase)   # a host-planned step (the map follows)

How a step works (``remap``): the layer's row of ``slot_map`` is looked up for the step's ids;
the experts used but not resident are ranked in expert-id order (mask, cumsum) and the
expert of rank r takes row r of the layer's staging block (``first_staging_row(layer) + r``);
ids become slot or staging rows. ``stage`` copies the staged experts' rows from the host
store into the staging rows: a fixed number of rows, ``min(T*K, E, R // blocks)``; rows
without a miss hold the sentinel E. On the CPU that is an index copy: in eager mode of the
rows with an expert only (a boolean mask, a data-dependent shape that costs the host
nothing: there is no device to wait for); traced (``torch.compile``) of all rows, sentinel
rows copying the layer's last expert, which is harmless: the kernel never reads them. On
CUDA the host store is pinned and read in place through a device view of it (zero-copy,
UVA: ``cuda_view``), by a Triton kernel whose masked loads read nothing for sentinel rows;
without Triton, by ``index_select`` on the view (sentinel rows then read the last expert
over the bus). ``apply`` is issued by the host between forwards (small copies); inside a
captured graph use ``fill_fixed`` + ``apply_fixed`` instead. Exactness: with ``fits(T)`` every
expert a step needs is in a slot or a staging row when the kernel runs.

Which experts are resident is the host's business (``expertcache.lagged.LaggedTable``,
one step behind): it reads the recorded routing after a forward and sends back slot
changes. A resident entry of ``slot_map`` must always name a slot that holds the expert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain

import torch

from ..lagged import LaggedTable
from ..stats import DECODE


class DeviceStep:
    """Slot map on the device, staging of misses, remap and kernel call; see the module doc."""

    def __init__(self, pool: dict[str, torch.Tensor], hosts: Sequence[dict[str, torch.Tensor]],
                 slots: int, *, top_k: int, max_tokens: int = 256, blocks: int = 1,
                 resident: dict[int, int] | None = None,
                 decoders: Sequence[Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] | None = None
                 ) -> None:
        # decoders (one per layer): the host stores hold stored bytes by part (a GGUF's
        # quantized experts) and decoders[l]({part: [n, bytes]}) -> {weight: [n, ...]} gives
        # the pool's rows (dequantized slots): a staged or loaded row crosses as bytes
        self.decoders = list(decoders) if decoders is not None else None
        if not pool or (self.decoders is None and any(set(h) != set(pool) for h in hosts)):
            raise ValueError(f"the pool's weights {sorted(pool)} and every layer's host store must "
                             "have the same names")
        size = {t.shape[0] for t in pool.values()}
        if len(size) != 1:
            raise ValueError(f"pool tensors differ in rows: {sorted(size)}")
        self.size = size.pop()  # S + R
        self.num_layers, self.top_k = len(hosts), top_k
        self.num_experts = next(iter(hosts[0].values())).shape[0]  # E
        # no staging row: allowed only when every expert of every layer has a slot (resident)
        complete = slots == self.num_layers * self.num_experts == len(resident or {}) == self.size
        if not (0 <= slots < self.size or complete):
            raise ValueError(f"slots={slots} leaves no staging row in a pool of {self.size} rows")
        self.pool, self.slots, self.staging = pool, slots, self.size - slots  # S, R
        self.complete = complete  # every expert resident: a step never stages
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= max(self.staging, 1):
            raise ValueError(f"staging blocks must be a whole number in 1..{self.staging}, got {blocks!r}")
        self.blocks, self.width = blocks, self.staging // blocks  # layer l stages into block l % blocks
        self.device = next(iter(pool.values())).device
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            prepare_triton()  # now, not first inside a traced step
        # L layers, E experts: slot of each expert, -1 when not resident
        self.slot_map = torch.full((self.num_layers, self.num_experts), -1, dtype=torch.int32,
                                   device=self.device)
        for key, slot in (resident or {}).items():
            self.slot_map[divmod(key, self.num_experts)] = slot
        self.hosts = list(hosts)
        # what stage() reads: the host store itself (CPU) or a device view of pinned memory (CUDA)
        self.sources = [{k: cuda_view(t, self.device) for k, t in h.items()} if self.cuda else h
                        for h in hosts]
        # the routing of the latest forward, per layer, for the host: pinned [L, max_tokens, K]
        self.max_tokens = max_tokens
        self.routed = torch.zeros((self.num_layers, max_tokens, top_k), dtype=torch.int32,
                                  pin_memory=self.cuda)
        self.routed_event = None  # CUDA: recorded after the last layer's copy (record())
        self._rows = torch.arange(self.num_experts, device=self.device)  # [E] expert ids

    # -- shapes ------------------------------------------------------------------------
    def fits(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens runs here: its misses fit the staging rows and
        its routing fits the record buffer (shapes only, no tensor is read)."""
        fit = self.complete or min(tokens * self.top_k, self.num_experts) <= self.width
        return fit and tokens <= self.max_tokens

    def staged_rows(self, tokens: int) -> int:
        """Staging rows one step of ``tokens`` tokens writes: ``min(T*K, E, R // blocks)``."""
        return min(tokens * self.top_k, self.num_experts, self.width)

    def first_staging_row(self, layer: int) -> int:
        """The pool row where ``layer``'s staging block starts: S + (layer % blocks) * width."""
        return self.slots + (layer % self.blocks) * self.width

    # -- the step ------------------------------------------------------------------------
    def remap(self, layer: int, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``topk_ids`` [T, K] expert ids -> (row ids [T, K] in topk_ids' dtype, staged [W] int64:
        the expert each of the first W = staged_rows(T) staging rows gets, E for none)."""
        # T tokens, K top-k, E experts, S slots, R staging rows, W staging rows this step writes
        return assign_staging(self.slot_map[layer], topk_ids, self.first_staging_row(layer),
                              self.staged_rows(topk_ids.shape[0]), self._rows)

    def stage(self, layer: int, staged: torch.Tensor) -> None:
        """Copy the staged experts' rows (``staged`` [W] from ``remap``) into the layer's staging
        block, rows first_staging_row(layer) + 0..W-1."""
        W, first = staged.shape[0], self.first_staging_row(layer)
        if self.decoders is not None:  # bytes across, dequantized on the device into the rows
            for kind, rows in self.fetch(layer, staged).items():
                self.pool[kind].narrow(0, first, W).copy_(rows)
            return
        for kind, dst in self.pool.items():
            src = self.sources[layer][kind]
            if src.shape[1:] == dst.shape[1:]:
                gather_rows(src, staged, dst.narrow(0, first, W))
            else:  # a layer's bytes narrower than the pool's rows (GGUF Q4_K_M): a row prefix
                rows = src.new_zeros((W, *src.shape[1:]))
                gather_rows(src, staged, rows)
                dst.narrow(0, first, W)[:, :src.shape[1]].copy_(rows)

    def fetch(self, layer: int, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The pool's weights [W, ...] of ``layer``'s experts ``rows`` [W] (E: sentinel, a row of
        no use) from its host store; with decoders: the bytes gathered, then dequantized."""
        if self.decoders is None:
            out = {}
            for kind, dst in self.pool.items():
                src = self.sources[layer][kind]
                out[kind] = dst.new_zeros((rows.shape[0], *dst.shape[1:]))
                if src.shape[1:] == dst.shape[1:]:
                    gather_rows(src, rows, out[kind])
                else:  # a layer's bytes narrower than the pool's rows: a row prefix
                    part = src.new_zeros((rows.shape[0], *src.shape[1:]))
                    gather_rows(src, rows, part)
                    out[kind][:, :src.shape[1]] = part
            return out
        raw = {}
        for part, src in self.sources[layer].items():   # [W, bytes]: zeros for sentinel rows
            raw[part] = src.new_zeros((rows.shape[0], *src.shape[1:]))
            gather_rows(src, rows, raw[part])
        return {kind: w.to(self.pool[kind].dtype) for kind, w in self.decoders[layer](raw).items()}

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Non-blocking copy of the step's ids [T, K] into the pinned routing buffer."""
        T = topk_ids.shape[0]
        self.routed[layer, :T].copy_(topk_ids, non_blocking=self.cuda)
        if self.cuda and layer == self.num_layers - 1 and not torch.compiler.is_compiling() \
                and not torch.cuda.is_current_stream_capturing():
            # traced or captured, the caller records the event after the call (runtime/graphs.py)
            self.routed_event = torch.cuda.current_stream(self.device).record_event()

    def run(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One MoE layer step: remap, stage the misses, call ``kernel(x, weights, row_ids)`` once."""
        row_ids, staged = self.remap(layer, topk_ids)
        self.stage(layer, staged)
        self.record(layer, topk_ids)
        return kernel(x, topk_weights, row_ids)

    def routing(self, layer: int, tokens: int) -> torch.Tensor:
        """The ids [T, K] layer ``layer`` recorded in the latest forward (host memory).

        On CUDA, wait for ``routed_event`` first (``LaggedDriver.observe`` does)."""
        return self.routed[layer, :tokens]

    # -- slot changes from the host ---------------------------------------------------------
    def apply(self, updates: Sequence[tuple[int, int, int, int]]) -> None:
        """Apply the host's slot changes ``(layer, expert, slot or -1, staging row or -1)``:
        the expert's map entry becomes ``slot``; a slot gets its weights from the staging row
        named (a device copy) or else from the host store (CUDA: through its device view).
        Issued by the host between forwards, batched: one copy per weight kind for the loads
        from staging rows and one per layer for those from the host (order-free: slots are
        distinct, and staging rows are never written here)."""
        if not updates:
            return
        self.write_map([(layer, expert, slot) for layer, expert, slot, _ in updates])
        # U updates with a slot: from a staging row, or from a layer's host store
        staged = [(slot, self.slots + source) for _, _, slot, source in updates if slot >= 0 and source >= 0]
        hosted: dict[int, list[tuple[int, int]]] = {}
        for layer, expert, slot, source in updates:
            if slot >= 0 and source < 0:
                hosted.setdefault(layer, []).append((slot, expert))
        if staged:
            dst_rows, src_rows = (self._index(c) for c in zip(*staged))
            for dst in self.pool.values():
                dst.index_copy_(0, dst_rows, dst.index_select(0, src_rows))
        for layer, pairs in hosted.items():
            dst_rows, experts = (self._index(c) for c in zip(*pairs))
            for kind, rows in self.fetch(layer, experts).items():
                self.pool[kind].index_copy_(0, dst_rows, rows)

    def _index(self, values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64).to(self.device, non_blocking=self.cuda)

    def write_map(self, entries: Sequence[tuple[int, int, int]]) -> None:
        """Set map entries ``(layer, expert, slot or -1)`` only: for slots the caller filled
        itself (a host-planned step)."""
        if not entries:
            return
        layers, experts, slots = (list(c) for c in zip(*entries))
        values = torch.tensor(slots, dtype=torch.int32).to(self.device, non_blocking=self.cuda)
        self.slot_map[torch.tensor(layers), torch.tensor(experts)] = values

    def fixed_buffers(self, capacity: int) -> dict[str, torch.Tensor]:
        """Buffers for ``apply_fixed`` holding up to ``capacity`` updates (pinned on CUDA): the
        host fills them (``fill_fixed``) and a captured graph applies them."""
        pin = self.cuda
        return {"layer": torch.zeros(capacity, dtype=torch.int64, pin_memory=pin),
                "expert": torch.full((capacity,), self.num_experts, dtype=torch.int64, pin_memory=pin),
                "slot": torch.full((capacity,), -1, dtype=torch.int64, pin_memory=pin),
                "source": torch.full((capacity,), -1, dtype=torch.int64, pin_memory=pin)}

    def fill_fixed(self, buffers: dict[str, torch.Tensor], updates: Sequence[tuple[int, int, int, int]]) -> None:
        """Write ``updates`` into ``buffers`` (host memory); unused entries become no-ops."""
        cap = buffers["layer"].shape[0]
        if len(updates) > cap:
            raise ValueError(f"{len(updates)} slot updates exceed the fixed list of {cap}")
        buffers["expert"].fill_(self.num_experts)
        buffers["slot"].fill_(-1)
        buffers["source"].fill_(-1)
        if updates:  # one write per column (the buffers are host memory)
            cols = torch.tensor([tuple(u) for u in updates], dtype=torch.int64).T  # [4, U]
            for name, col in zip(("layer", "expert", "slot", "source"), cols):
                buffers[name][:len(updates)] = col

    def apply_fixed(self, buffers: dict[str, torch.Tensor]) -> None:
        """Apply a fixed-size update list on the device: no host read, fixed shapes.

        Each entry writes the map (entries with expert E are dropped into a spare column) and
        copies one row into its slot: from the staging row when ``source >= 0``, else from the
        host store (CPU: index copy; CUDA: through the pinned store's device view). Entries
        without a slot copy into the spare staging row S+R-1, which no step then reads before it
        is staged again. Use between forwards, before the first layer's step. Every entry copies
        a row, used or not: a list sized for the worst forward (2 x L x B x K at lag 1) copies
        that many rows each time, which is why replayed decode (runtime/graphs.py) applies the
        actual updates with ``apply`` between replays instead."""
        # U updates; E experts; S slots; R staging rows
        dev = {k: v.to(self.device, non_blocking=self.cuda) for k, v in buffers.items()}
        E, spare = self.num_experts, self.size - 1
        layer, expert, slot, source = dev["layer"], dev["expert"], dev["slot"], dev["source"]
        wide = torch.cat([self.slot_map, self.slot_map.new_full((self.num_layers, 1), -1)], dim=1)  # [L, E+1]
        wide.index_put_((layer, expert), slot.to(torch.int32))
        self.slot_map.copy_(wide[:, :E])
        dst_row = torch.where(slot >= 0, slot, spare)                        # [U]
        from_staging = source >= 0                                          # [U]
        staging_row = torch.where(from_staging, self.slots + source, spare)  # [U]
        rows = {kind: dst.index_select(0, staging_row) for kind, dst in self.pool.items()}  # [U, ...]
        for layer_id in range(self.num_layers):  # per layer: its host store; shapes fixed
            mine = (layer == layer_id) & ~from_staging & (slot >= 0)
            host_rows = torch.where(mine, expert.clamp(max=E - 1), E)       # E: sentinel
            for kind, fetched in self.fetch(layer_id, host_rows).items():
                rows[kind] = torch.where(mine.view(-1, *[1] * (fetched.ndim - 1)), fetched, rows[kind])
        for kind, dst in self.pool.items():
            dst.index_copy_(0, dst_row, rows[kind])


class LaggedDriver:
    """The host's side of a ``DeviceStep``, once per forward (engine-agnostic).

    ``begin(tokens, decode)`` before each forward: hands the previous device forward's routing
    to ``lagged`` (``observe``), applies the decisions now due (``lag`` forwards old; all of
    them before a host-planned forward) and returns whether this forward runs on the device
    (decode that ``step.fits``). A host-planned forward calls ``host_step`` per layer for its
    plan (the device map follows it; the engine copies the weights itself). ``copies``
    [phase][layer]: experts copied from the host by the device path (staged misses, loads
    without a staging row). ``before_apply(device)``: a hook for engines that must order
    streams at the switch.
    """

    def __init__(self, step: DeviceStep, lagged: LaggedTable) -> None:
        self.step, self.lagged = step, lagged
        self._recorded = 0   # tokens of the last device forward, not yet observed (0: none)
        self.copies = [[0] * step.num_layers for _ in range(2)]
        self.device_forwards = self.host_forwards = 0

    def begin(self, tokens: int | None, decode: bool) -> bool:
        self.observe()
        device = bool(decode) and tokens is not None and self.step.fits(tokens)
        updates = self.lagged.begin() if device else self.lagged.flush()
        for layer, _expert, slot, source in updates:
            if slot >= 0 and source < 0:
                self.copies[DECODE][layer] += 1
        self.before_apply(device)
        self.step.apply(updates)
        if device:
            self._recorded, self.device_forwards = tokens, self.device_forwards + 1
        else:
            self.host_forwards += 1
        return device

    def before_apply(self, device: bool) -> None:
        pass

    def observe(self) -> None:
        """Hand the last device forward's routing to the lagged table (once; on CUDA after the
        routing's copy to host memory completed)."""
        T, self._recorded = self._recorded, 0
        if not T:
            return
        step = self.step
        if step.routed_event is not None:
            step.routed_event.synchronize()
        steps = [list(dict.fromkeys(chain.from_iterable(step.routing(l, T).tolist())))
                 for l in range(step.num_layers)]
        resident, E = self.lagged.resident, step.num_experts
        for layer, experts in enumerate(steps):  # every miss is one copy into a staging row
            self.copies[DECODE][layer] += sum(1 for e in experts if layer * E + e not in resident)
        self.lagged.observe(steps, DECODE, step.staged_rows(T))

    def host_step(self, layer: int, experts: Sequence[int], phase: int):
        """The table's plan for a host-planned step (``Plan``); the device map follows it."""
        plan = self.lagged.host_step(layer, experts, phase)
        if plan.evictions or plan.loads:
            E = self.step.num_experts
            entries = dict.fromkeys(plan.evictions, -1)
            entries.update(plan.loads)
            self.step.write_map([(k // E, k % E, s) for k, s in entries.items()])
        return plan


def assign_staging(row: torch.Tensor, topk_ids: torch.Tensor, first: int, width: int,
                   experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-shape core of a step (see ``DeviceStep.remap``).

    row int32 [E] (slot or -1); topk_ids [T, K]; ``width`` W staging rows from pool row
    ``first`` on may be given out;
    experts = arange(E). Returns row ids [T, K] (topk_ids' dtype) and staged int64 [W]
    (expert per staging row, E for none). Misses beyond W (never with ``fits``) are clamped to
    the last row, so ids stay inside the pool.
    """
    # T tokens, K top-k, E experts, W staging rows this step
    E = row.shape[0]
    flat = topk_ids.reshape(-1).long()                                     # [T*K]
    used = torch.zeros(E, dtype=torch.bool, device=row.device).index_fill(0, flat, True)  # [E]
    missed = used & (row < 0)                                              # [E]
    rank = torch.cumsum(missed.to(torch.int64), 0) - 1                     # [E] rank among misses
    rank = rank.clamp(min=0, max=max(width - 1, 0))
    where = torch.where(missed, first + rank, row.long())                  # [E] row of each expert
    row_ids = where.index_select(0, flat).view(topk_ids.shape).to(topk_ids.dtype)  # [T, K]
    target = torch.where(missed, rank, width)                              # [E], W = no row
    staged = torch.full((width + 1,), E, dtype=torch.int64, device=row.device)
    staged = staged.scatter_reduce(0, target, experts, reduce="amin")      # [W+1]
    return row_ids, staged[:width]


def gather_rows(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = src[rows[i]]`` for rows below E = src.shape[0]; rows equal to E (sentinels)
    are skipped (CUDA with Triton; the CPU in eager mode) or copy ``src[E-1]`` (otherwise).
    src [E, ...]; rows [W]; out [W, ...]."""
    E = src.shape[0]
    if out.device.type == "cuda":
        if _triton_ok(src, out):
            _triton_gather(src, rows, out)
        else:
            torch.index_select(src, 0, rows.clamp(max=E - 1), out=out)
        return
    if not torch.compiler.is_compiling():
        # CPU, eager: copy the rows that hold an expert only. The mask makes a data-dependent
        # shape, which costs nothing on the host (no device to wait for, no graph to keep);
        # traced code takes the fixed-width copy below
        keep = (rows < E).nonzero().squeeze(1)                         # [M] rows with an expert
        out.index_copy_(0, keep, src.index_select(0, rows.index_select(0, keep)))
        return
    torch.index_select(src, 0, rows.clamp(max=E - 1), out=out)


# -- CUDA: pinned host memory read in place ------------------------------------------------
class _CudaArray:
    """A ``__cuda_array_interface__`` over a device pointer (torch.as_tensor then wraps it)."""

    def __init__(self, ptr: int, nbytes: int, owner: torch.Tensor) -> None:
        self.owner = owner  # keeps the pinned memory alive as long as the view
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def device_pointer(host: torch.Tensor) -> int:
    """The device address of pinned ``host`` memory (``cudaHostGetDevicePointer``); where the
    CUDA runtime cannot be reached, the host address (unified addressing maps pinned pages at
    the same address on the device)."""
    import ctypes

    lib = _cudart()
    if lib is not None:
        ptr = ctypes.c_void_p()
        if lib.cudaHostGetDevicePointer(ctypes.byref(ptr), ctypes.c_void_p(host.data_ptr()), 0) == 0:
            return ptr.value
    return host.data_ptr()


_CUDART: list = []


def _cudart():
    """The CUDA runtime library torch loaded (by soname), or None."""
    if not _CUDART:
        import ctypes
        found = None
        for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
            try:
                found = ctypes.CDLL(name)
                break
            except OSError:
                continue
        _CUDART.append(found)
    return _CUDART[0]


def cuda_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over pinned host memory: same shape and dtype, no copy (zero-copy reads
    over the bus). ValueError for memory that is not pinned."""
    if not host.is_pinned():
        raise ValueError("a device view needs pinned host memory (host_memory='copy' pins with CUDA)")
    if not host.is_contiguous():
        raise ValueError("a device view needs a contiguous host tensor")
    nbytes = host.numel() * host.element_size()
    with torch.cuda.device(device):
        raw = torch.as_tensor(_CudaArray(device_pointer(host), nbytes, host), device=device)
    view = raw.view(host.dtype).view(host.shape)
    view._expertcache_owner = host  # noqa: SLF001  the pinned tensor outlives the view
    return view


_TRITON: list[bool] = []  # [whether triton imports], filled once, eagerly (prepare_triton)


def prepare_triton() -> bool:
    """Import Triton and define the copy kernel once, outside any trace: code that
    ``torch.compile`` traces then only reads these module lists (runtime/graphs.py)."""
    if not _TRITON:
        try:
            import triton  # noqa: F401
            _TRITON.append(True)
        except ImportError:
            _TRITON.append(False)
    if _TRITON[0]:
        _copy_rows_kernel()
    return _TRITON[0]


def _triton_ok(src: torch.Tensor, out: torch.Tensor) -> bool:
    if not prepare_triton():
        return False
    return src.is_contiguous() and out.is_contiguous() and src.dtype == out.dtype


_KERNEL = []


def _triton_gather(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """Masked row copy on a fixed grid (W rows x blocks): a sentinel row loads and stores nothing."""
    kernel = _copy_rows_kernel()
    W, E = rows.shape[0], src.shape[0]
    row_elems = src[0].numel()
    BLOCK = 4096
    grid = (W, (row_elems + BLOCK - 1) // BLOCK)
    kernel[grid](src, rows, out, row_elems, E, BLOCK=BLOCK)


def _copy_rows_kernel():
    if not _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_rows(src_ptr, rows_ptr, out_ptr, row_elems, num_rows, BLOCK: tl.constexpr):
            i = tl.program_id(0)
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            r = tl.load(rows_ptr + i)
            # the row test as a block (offs * 0 + r): Triton's interpreter refuses block & scalar
            mask = (offs < row_elems) & ((offs * 0 + r) < num_rows)
            vals = tl.load(src_ptr + r.to(tl.int64) * row_elems + offs, mask=mask)
            tl.store(out_ptr + i.to(tl.int64) * row_elems + offs, vals, mask=mask)

        _KERNEL.append(copy_rows)
    return _KERNEL[0]
