"""The RAM tier: ``host_memory='tiered'``, a cache of experts in RAM over the model file.

For models larger than RAM. Instead of memory-mapping the file and leaving the OS page cache
to decide what stays (4 KiB pages, readahead past each expert, eviction that knows nothing of
experts), the host keeps ``host_budget`` experts in rows of its own buffers (pinned with CUDA),
chosen by a ``SlotTable`` under ``host_policy`` (any policy of the registry: the same code
that runs the device slots and the simulator, so ``sim/tiers.py`` replays it exactly). A
step's experts missing from RAM are read from the file with ``O_DIRECT``, all at once, at the
offsets the GGUF header gives: through Linux's native AIO where it is allowed
(``runtime/kernelaio.py``), else by a few reader threads (``runtime/directio.py``);
``stats()['reader']`` says which, and why.

Keys, phases and the step order are the device table's: the CPU engine's resident run asks
the tier for every step's experts; a run with device slots asks it for the experts a slot
plan loads or bypasses (a slot miss is served from RAM, else from the file).

Shapes: ``TieredStore.pool[part]`` is ``[R, stride]`` uint8, R rows of the RAM tier, stride
the largest of that part's per-expert bytes over the layers (llama.cpp's Q4_K_M mixes types
by layer); ``TieredExperts.tensors[part]`` is the ``[R, nbytes]`` view one layer reads.

Under the CPU engine's graph decode (runtime/ggmltier.py) the rows of the parts ggml repacks
hold ggml's repacked layout (``repack_rows``): each read is repacked from its bounce buffer
into the row as it lands (on the reader thread, or with kernel AIO on the thread that collects
it), and every reader of the rows (the graph, the per-layer
kernels, compact copies, read-ahead) reads them as repacked.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..cache import SlotTable
from ..config import host_budget_rows
from ..sizes import format_size
from ..stats import DECODE, PREFILL
from .device import host_room
from .directio import READERS, DirectFile, ReadCounters, ReadPool
from .host import zeroed
from .kernelaio import open_aio
from .quantized import Codec


@dataclass
class Pending:
    """A step of the tier whose reads may still run: ``rows`` expert -> row (of the pool, or of
    ``compact`` for a step wider than the tier), ``reading`` the experts being read."""

    rows: dict[int, int]
    reading: set[int]
    phase: int
    compact: dict[str, np.ndarray] | None = None
    copies: dict[int, int] = field(default_factory=dict)  # compact row <- pool slot, once read
    futures: list = field(default_factory=list)
    t0: float = 0.0
    started: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))  # ReadPool.settle


class TierBrokenError(RuntimeError):
    """A step of the RAM tier failed after placing its loads; the tier refuses every later step."""


@dataclass(frozen=True)
class PartRange:
    """Where one layer's part lives in the file: ``[E, nbytes]`` from byte ``offset`` of ``file``
    (a GGUF's stacked experts), or, where each expert is a tensor of its own (a safetensors
    checkpoint's ``experts.N.*``), expert ``e`` at ``experts[e]`` = (file, offset)."""

    file: Path
    offset: int
    nbytes: int  # per expert
    experts: tuple[tuple[Path, int], ...] | None = None

    def where(self, expert: int) -> tuple[Path, int]:
        """(file, byte offset) of ``expert``'s bytes."""
        if self.experts is not None:
            return self.experts[expert]
        return self.file, self.offset + expert * self.nbytes

    def ends(self, num_experts: int) -> dict[Path, int]:
        """The furthest byte each file must hold for these experts (checked at load and before reads)."""
        out: dict[Path, int] = {}
        for e in (range(num_experts) if self.experts is not None else (num_experts - 1,)):
            path, offset = self.where(e)
            out[path] = max(out.get(path, 0), offset + self.nbytes)
        return out


class TieredStore:
    """The RAM tier of one model: rows, the table choosing them, the files and their reader.

    ``layers[l][part]``: that part's ``PartRange``; ``rows``: experts the tier holds;
    ``policy``: its eviction (a name, ``PolicySpec`` or instance); ``cuda``: pin the rows.
    """

    def __init__(self, layers: list[dict[str, PartRange]], num_experts: int, rows: int, policy, top_k: int,
                 cuda: bool = False, direct: bool = True, threads: int = READERS) -> None:
        self.num_layers, self.num_experts, self.rows = len(layers), num_experts, rows
        self.layers = layers
        names = set(layers[0])
        if any(set(layer) != names for layer in layers):
            raise ValueError("the RAM tier needs the same expert tensors in every MoE layer")
        self.stride = {p: max(layer[p].nbytes for layer in layers) for p in sorted(names)}
        self.row_bytes = sum(self.stride.values())
        self.table = SlotTable(self.num_layers, num_experts, rows, eviction=policy, admission="always",
                               partition="global", top_k=top_k)
        ends: dict[Path, int] = {}
        for layer in layers:
            for part in layer.values():
                for path, end in part.ends(num_experts).items():
                    ends[path] = max(ends.get(path, 0), end)
        self.files = {path: DirectFile(path, need, direct) for path, need in ends.items()}
        self.direct = all(f.direct for f in self.files.values())
        self.read_reason = next(iter(self.files.values())).mode_reason if self.direct else \
            next(f.mode_reason for f in self.files.values() if not f.direct)
        self.pool = {p: _buffer(rows, s, cuda) for p, s in self.stride.items()}
        self._np = {p: t.numpy() for p, t in self.pool.items()}
        self.reader, why = open_aio(self.files.values())
        if self.reader is None:
            self.reader = ReadPool(threads)
            self.reader.kind += f" ({why})"
        self.before_write = None  # set by the engine with CUDA: waits for copies out of the rows
        self.ahead = None  # the graph decode's read-ahead (runtime/ggmltier.py Prefetch), counted here
        # per layer: part -> ggmlrepack.RowRepack for the parts whose rows hold ggml's repacked
        # layout (the graph decode's choice, ``repack_rows``); None: every row the file's bytes
        self.repack: list[dict] | None = None
        self.broken = ""  # why a step failed after placing its loads (then every step is refused)
        self.reset_stats()

    def repack_rows(self, packers: list[dict]) -> None:
        """From now on the rows of ``packers[layer]``'s parts hold ggml's repacked layout (reads
        are repacked into them); rows filled before are repacked now. CPU only: a copy from a
        row to a device slot must see the file's bytes."""
        if self.before_write is not None or len(packers) != self.num_layers:
            raise ValueError("the RAM tier's rows are repacked for the CPU engine only, one packer map a layer")
        for key, slot in self.table.resident().items():
            for p, packer in packers[key // self.num_experts].items():
                plain = self._np[p][slot, :packer.nbytes].copy()
                packer.pack(self._np[p][slot].ctypes.data, plain.ctypes.data)
        self.repack = packers if any(packers) else None

    def repacked_parts(self) -> list[str]:
        """The parts whose rows hold ggml's repacked layout in some layer."""
        return sorted({p for layer in self.repack or () for p in layer})

    # -- one step ---------------------------------------------------------------------
    def fetch(self, layer: int, experts: list[int], phase: int) -> tuple[dict[str, np.ndarray] | None, dict[int, int]]:
        """Make ``experts`` of ``layer`` (unique, rank order) readable: ``(tensors, rows)``.

        ``tensors`` is None when every expert has a row of the pool (``rows``: expert -> row);
        a step wider than the tier (its bypasses) gets a compact copy instead: ``tensors[part]``
        ``[W, stride]`` holding the W experts, ``rows`` into it."""
        pending = self.start(layer, experts, phase)
        self.finish(pending)
        return pending.compact, pending.rows

    def start(self, layer: int, experts: list[int], phase: int, ahead=None) -> Pending:
        """Plan the step and start its reads; ``finish`` waits for them. Rows of the step's RAM hits
        can be read meanwhile (reads only write the rows of the experts in ``Pending.reading``).

        ``ahead(layer, expert, dst, row)``: an expert read ahead of its step (the graph's prefetch,
        runtime/ggmltier.py) copied into ``dst[part][row]``, its ``ReadCounters``; or None: read it
        now. The table plans the step either way: its counts do not depend on the prefetch."""
        if self.broken:
            raise TierBrokenError(f"the RAM tier stopped after a failed step ({self.broken}); rows it was "
                                  "filling may hold other experts' bytes: reload the model once the file reads")
        t0 = time.perf_counter()
        early = self._read_early(layer, experts)
        plan = self.table.step(layer, experts, phase)
        try:
            return self._start(layer, plan, phase, ahead, early, t0)
        except BaseException as err:
            self._broke(err)
            raise

    def _read_early(self, layer: int, experts: list[int]) -> dict[int, list]:
        """Kernel AIO on the CPU: the reads of the step's experts missing from the tier (and not
        read ahead) go to the kernel before the table plans the step, so the disk starts that much
        sooner (the table, the reads' plan and the file check: about 0.1 ms a layer); their
        payloads land in the rows the plan names (``AioPool.bind``) in ``finish``. expert -> its
        reads, one a part."""
        if not hasattr(self.reader, "bind") or self.before_write is not None:  # CUDA: rows wait for copies first
            return {}
        base, ahead = layer * self.num_experts, self.ahead
        missing = [e for e in experts if self.table.slot_of(base + e) is None
                   and not (ahead is not None and ahead.holds(layer, e))]
        if not missing:
            return {}
        jobs = [job for e in missing for job in self.loose_jobs(layer, e)]
        reads, parts = self.reader.submit(jobs), len(self.layers[layer])
        return {e: reads[i * parts:(i + 1) * parts] for i, e in enumerate(missing)}

    def _broke(self, err: BaseException) -> None:
        """A step failed after the table placed its loads: their rows may hold other experts' bytes
        (or half of one), so every later step is refused (``TierBrokenError``), never computed."""
        self.broken = self.broken or f"{type(err).__name__}: {err}"

    def _start(self, layer: int, plan, phase: int, ahead, early: dict[int, list], t0: float) -> Pending:
        base = layer * self.num_experts
        rows = {key - base: slot for key, slot in plan.hits.items()}
        rows.update((key - base, slot) for key, slot in plan.loads.items())
        jobs, reading, bound = [], set(), []
        for key, slot in plan.loads.items():
            new, flying = self._fill(layer, key - base, self._np, slot, phase, ahead, early)
            if new or flying:  # not read ahead: being read now
                jobs += new
                bound += flying
                reading.add(key - base)
        pending = Pending(rows, reading, phase)
        if plan.bypasses:  # wider than the tier: every expert of the step into one compact copy
            width = len(rows) + len(plan.bypasses)
            compact = {p: np.empty((width, s), np.uint8) for p, s in self.stride.items()}
            for i, (e, slot) in enumerate(rows.items()):
                if e + base not in plan.loads:  # loads are copied once read (finish)
                    for p in compact:
                        compact[p][i] = self._np[p][slot]
                rows[e] = i
            for i, key in enumerate(plan.bypasses, start=len(rows)):
                new, flying = self._fill(layer, key - base, compact, i, phase, ahead, early)
                jobs += new
                bound += flying
                rows[key - base] = i
            pending.compact = compact
            pending.copies = {rows[key - base]: slot for key, slot in plan.loads.items()}
            pending.reading |= {key - base for key in plan.bypasses}
        unbound = [r for reads in early.values() for r in reads]  # none expected: collected, landing nowhere
        if jobs or bound or unbound:
            if jobs and self.before_write is not None:  # CUDA: no copy to a slot may still read these rows
                self.before_write()
            for f in self.files.values():  # before any payload lands (the early reads' too)
                f.check()
            pending.t0 = t0 if bound or unbound else time.perf_counter()
            pending.futures = bound + unbound + (self.reader.submit(jobs, pending.started) if jobs else [])
        return pending

    def settle(self, pending: Pending) -> None:
        """Return once ``pending``'s first reads are on the reader threads (``ReadPool.settle``):
        called before computing beside them on every core."""
        if pending.futures:
            self.reader.settle(pending.started, len(pending.futures))

    def stand_ins(self, pending: Pending) -> dict[int, int] | None:
        """A row of its own for each expert being read, to compute its pairs on while the read runs
        (their outputs are replaced once it is read): rows no expert of the step is in, so no read
        writes them and no row repeats within a token. ggml's repacked ``mul_mat_id`` sizes its row
        table for each row once a token ([rows][tokens], repack.cpp): a row named twice in one
        token writes past its work buffer. None when the tier has too few spare rows."""
        need = sorted(pending.reading)
        taken = set(pending.rows.values())
        spare = [r for r in range(min(self.rows, len(taken) + len(need))) if r not in taken]
        return dict(zip(need, spare)) if len(spare) >= len(need) else None

    def finish(self, pending: Pending) -> None:
        """Wait for ``pending``'s reads; count them (``read_seconds``: from their start, ``wait_seconds``:
        the part the caller waited for)."""
        try:
            self._collect(pending)
        except BaseException as err:
            self._broke(err)
            raise
        for row, slot in pending.copies.items():  # loads landed in the pool: into the compact copy too
            for p in pending.compact:
                pending.compact[p][row] = self._np[p][slot]
        pending.copies = {}

    def _collect(self, pending: Pending) -> None:
        if pending.futures:
            futures, pending.futures = pending.futures, []
            t = time.perf_counter()
            self.counts[pending.phase].add(self.reader.collect(futures, pending.t0))
            self.waited[pending.phase] += time.perf_counter() - t

    def _fill(self, layer: int, expert: int, dst: dict[str, np.ndarray], row: int, phase: int, ahead,
              early: dict[int, list]) -> tuple[list, list]:
        """Put ``expert`` into ``dst[part][row]``: (reads to submit, reads in flight now landing
        there). Its reads started early (``_read_early``) are bound to the row; neither where
        ``ahead`` had it."""
        if expert in early:
            reads = early.pop(expert)
            self.bind(layer, expert, reads, dst, row)
            return [], reads
        if ahead is not None:
            t = time.perf_counter()
            got = ahead(layer, expert, dst, row)
            if isinstance(got, list):  # read ahead, still in the kernel, now bound to the row: lands in finish
                return [], got
            if got is not None:  # its bytes count as this step's read (what the table counts)
                self.counts[phase].add(got)
                self.waited[phase] += time.perf_counter() - t
                return [], []
        return self._jobs(layer, expert, dst, row), []

    def _jobs(self, layer: int, expert: int, dst: dict[str, np.ndarray], row: int, plain: bool = False) -> list:
        """The reads of ``expert`` into ``dst[part][row]``: repacked there where the tier's rows
        are (``repack``), unless ``plain`` (the read-ahead's staging rows: repacked when taken)."""
        out = []
        for p, n, f, offset, what in self._parts(layer, expert):
            view, put = self._target(layer, p, n, dst, row, plain)
            out.append((f, view, offset, what) if put is None else (f, view, offset, what, put))
        return out

    def loose_jobs(self, layer: int, expert: int) -> list:
        """The reads of ``expert`` with no destination yet (kernel AIO; ``bind`` names it later)."""
        return [(f, None, offset, what, None, n) for _, n, f, offset, what in self._parts(layer, expert)]

    def bind(self, layer: int, expert: int, reads: list, dst: dict[str, np.ndarray], row: int) -> None:
        """``expert``'s reads started by ``loose_jobs`` land in ``dst[part][row]`` (repacked where the rows are)."""
        for r, (p, n, *_) in zip(reads, self._parts(layer, expert)):
            self.reader.bind(r, *self._target(layer, p, n, dst, row))

    def _parts(self, layer: int, expert: int):
        """(part, bytes, file, offset, what) of each part of ``expert``, in the layer's part order."""
        for p, rng in self.layers[layer].items():
            path, offset = rng.where(expert)
            yield p, rng.nbytes, self.files[path], offset, f"layer {layer} expert {expert} ({p}, {rng.nbytes} bytes)"

    def _target(self, layer: int, part: str, n: int, dst: dict[str, np.ndarray], row: int, plain: bool = False):
        """Where a read of ``part`` lands: the row's view, and the repack into it (or None: copied)."""
        view = dst[part][row, :n]
        packer = None if plain else self._packer(layer, part)
        return view, None if packer is None else partial(packer.pack, view.ctypes.data)

    def _packer(self, layer: int, part: str):
        """The ``RowRepack`` of ``part``'s rows at ``layer``, or None: they hold the file's bytes."""
        return None if self.repack is None else self.repack[layer].get(part)

    def put(self, layer: int, part: str, dst: np.ndarray, src: np.ndarray) -> None:
        """An expert's file bytes ``src`` into the row ``dst`` (repacked where the tier's rows are)."""
        packer = self._packer(layer, part)
        if packer is None:
            dst[:src.nbytes] = src
        else:
            packer.pack(dst.ctypes.data, src.ctypes.data)

    # -- counters -----------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.table.reset_stats()
        self.counts = [ReadCounters(), ReadCounters()]  # [phase]
        self.waited = [0.0, 0.0]  # [phase] seconds a step waited for its reads (the rest overlapped)
        self.tokens = [0, 0]
        if getattr(self, "ahead", None) is not None:
            self.ahead.reset()

    def stats(self) -> dict:
        """RAM-tier hits, file reads (experts), bytes read per phase and per decode token, read time."""
        table = self.table.stats()
        out = {"rows": self.rows, "bytes": self.rows * self.row_bytes, "policy": self.table.eviction_name,
               "reads": "O_DIRECT" if self.direct else "buffered+DONTNEED", "read_reason": self.read_reason,
               "reader_threads": self.reader.threads, "reader": self.reader.kind,
               "repacked": self.repacked_parts()}
        for phase, name in ((PREFILL, "prefill"), (DECODE, "decode")):
            sums, c = table.sums(phase), self.counts[phase]
            tok = self.tokens[phase]
            out[name] = {"accesses": sums["accesses"], "ram_hits": sums["hits"],
                         "file_reads": sums["loads"] + sums["bypasses"], "read_ranges": c.reads,
                         "file_bytes": c.bytes, "disk_bytes": c.disk_bytes, "read_seconds": round(c.seconds, 6),
                         "wait_seconds": round(self.waited[phase], 6),
                         "tokens": tok, "file_bytes_per_token": c.bytes / tok if tok else 0.0}
        if self.ahead is not None:  # reads ahead of decode steps; file_bytes holds the used ones
            out["prefetch"] = self.ahead.stats()
        return out

    def summary_line(self) -> str:
        s = self.stats()
        d = s["decode"]
        rate = d["ram_hits"] / d["accesses"] if d["accesses"] else 0.0
        return (f"RAM tier: {s['rows']} experts ({format_size(s['bytes'])}), {s['policy']}; decode RAM hits "
                f"{rate:.1%}, {d['file_reads']} experts read from the file, "
                f"{format_size(d['file_bytes_per_token'])} per token, {d['read_seconds']:.2f} s reading, "
                f"{d['wait_seconds']:.2f} s of it waited for ({s['reads']}: {s['read_reason']})"
                + (f"; rows of {', '.join(s['repacked'])} repacked for ggml's CPU kernels" if s["repacked"] else "")
                + ("" if self.ahead is None else
                   f"; read ahead {s['prefetch']['read_ahead']} experts, {s['prefetch']['used']} used, "
                   f"{format_size(s['prefetch']['wasted_bytes'])} read for nothing"))

    def close(self) -> None:
        self.reader.close()
        for f in self.files.values():
            f.close()


def _buffer(rows: int, stride: int, cuda: bool) -> torch.Tensor:
    """[rows, stride] zeros, touched now: the budget is resident from the load (page-locked with CUDA)."""
    return zeroed(rows * stride, pinned=cuda).view(rows, stride)


class TieredExperts:
    """One MoE layer's experts in the RAM tier: what the engine holds as a host (``tensors``
    are the pool's rows; expert ``e`` is row ``rows[e]`` of the step that fetched it)."""

    tiered = True
    transposed = False

    def __init__(self, store: TieredStore, layer: int, codec: Codec, reason: str) -> None:
        self.store, self.layer, self.codec = store, layer, codec
        self.num_experts = store.num_experts
        self.expert_bytes = codec.expert_bytes
        self.mode, self.mode_reason = "tiered", reason
        self.tensors = {p: store.pool[p][:, :codec.part[p].nbytes] for p in store.stride}

    def count_tokens(self, phase: int, tokens: int) -> None:
        """A step of ``tokens`` tokens ran at this layer (counted at layer 0: bytes per token)."""
        if self.layer == 0:
            self.store.tokens[phase] += tokens

    def fetch(self, experts: list[int], phase: int) -> StepView:
        """The step's ``experts`` (unique, rank order) readable from RAM: read what is missing."""
        pending = self.store.start(self.layer, experts, phase)
        self.store.finish(pending)
        return self._view(pending)

    def routed(self, kernel, module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               experts: list[int], phase: int) -> torch.Tensor:
        """The CPU engine's resident step over the RAM tier: start the reads of the missing experts,
        compute the pairs of the experts in RAM while they run, then the rest (``_overlapped``);
        ids remapped to rows. hidden [T, H], top_k_index [T, K]; returns [T, H]."""
        self.count_tokens(phase, top_k_index.shape[0])
        pending = self.store.start(self.layer, experts, phase)
        if pending.futures and pending.compact is None and kernel._silu_gate(module):
            stand_ins = self.store.stand_ins(pending)
            if stand_ins is not None:
                return _overlapped(kernel, self.store, pending, stand_ins, hidden, top_k_index, top_k_weights,
                                   self.tensors)
        self.store.finish(pending)
        view = self._view(pending)
        return kernel.routed(module, hidden, view.remap(top_k_index), top_k_weights, view.tensors)

    def _view(self, pending: Pending) -> StepView:
        tensors = self.tensors if pending.compact is None else \
            {p: torch.from_numpy(t[:, :self.codec.part[p].nbytes]) for p, t in pending.compact.items()}
        return StepView(tensors, pending.rows, self.codec)

    def restore(self, module: torch.nn.Module) -> None:
        """Nothing to hand back: a GGUF model's experts modules never held weights."""


class StepView:
    """One step's experts as rows of ``tensors[part]`` ``[n, nbytes]``: what the slot pool copies
    from (``pool.load(slot, view, view.rows[e])``) and the CPU paths compute on."""

    transposed = False

    def __init__(self, tensors: dict[str, torch.Tensor], rows: dict[int, int], codec: Codec) -> None:
        self.tensors, self.rows, self.codec = tensors, rows, codec
        self.expert_bytes = codec.expert_bytes

    def remap(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, K] -> rows of ``tensors`` [T, K] (int64)."""
        lut = torch.zeros(max(self.rows) + 1, dtype=torch.int64)
        lut[list(self.rows)] = torch.tensor(list(self.rows.values()), dtype=torch.int64)
        return lut[top_k_index.cpu()]

    def expert(self, expert: int) -> dict[str, torch.Tensor]:
        """One expert's compute weights, dequantized (the torch CPU miss path)."""
        row = self.rows[expert]
        decoded = self.codec.decode({k: t[row:row + 1] for k, t in self.tensors.items()})
        return {k: t[0] for k, t in decoded.items()}


def _overlapped(kernel, store: TieredStore, pending: Pending, stand_ins: dict[int, int], hidden: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``GgmlExperts.routed`` in two passes around the reads: the pairs of experts in RAM first (the
    missing ones pointed at their ``stand_ins`` rows, ``TieredStore.stand_ins``, their outputs
    replaced after), then the missing ones' pairs alone, once read. ggml computes each (token,
    expert) pair on its own (the same bytes whatever else is in the graph), so the result is the
    one-pass result bit for bit
    (``tests/test_tiers.py``). hidden [T, H], top_k_index [T, K] -> [T, H]."""
    T, K = top_k_index.shape
    rows = pending.rows
    lut = torch.zeros(max(rows) + 1, dtype=torch.int32)
    lut[list(rows)] = torch.tensor(list(rows.values()), dtype=torch.int32)
    ids = lut[top_k_index.cpu()].contiguous()                                       # [T, K] rows
    reading = torch.zeros(max(rows) + 1, dtype=torch.bool)
    reading[list(pending.reading)] = True
    miss = reading[top_k_index.cpu()].reshape(-1)                                    # [T*K] pairs read now
    if not miss.all():  # the RAM hits, while the reads run (their rows are not being written)
        lut[list(stand_ins)] = torch.tensor(list(stand_ins.values()), dtype=torch.int32)
        out = kernel._silu_mlp(hidden, lut[top_k_index.cpu()].contiguous(), tensors)  # [T*K, H]
    else:
        out = torch.empty(T * K, kernel.part[kernel.down.parts[0]].shape[0])
    store.finish(pending)
    pairs = miss.nonzero().squeeze(1)                                                # [N]
    x = hidden.index_select(0, pairs // K)                                           # [N, H]
    out[pairs] = kernel._silu_mlp(x, ids.view(-1)[pairs].view(-1, 1).contiguous(), tensors)
    w = top_k_weights.to(out.dtype).unsqueeze(1)                                     # [T, 1, K]
    return torch.bmm(w, out.view(T, K, -1)).squeeze(1).to(hidden.dtype)              # [T, H]


# host_budget='auto' leaves this share of the free RAM (at least AUTO_MARGIN_MIN) to everything
# but the tier: the KV cache, ggml's work buffers, the bounce buffers, Python and torch
AUTO_MARGIN, AUTO_MARGIN_MIN = 0.15, 2 << 30


def auto_rows(free: int | None, dense_bytes: int, total: int, row_bytes: int) -> tuple[int, str]:
    """``host_budget='auto'``: the experts that fit in the RAM free at load (``host_room``: a
    memory cgroup's limit counts) less the dense weights not yet loaded (``dense_bytes``) and a
    margin; every expert where they all fit. (rows, how they were sized, for messages)."""
    if free is None:
        raise ValueError("host_budget='auto' sizes the tier from the free RAM, which cannot be read here "
                         "(no /proc/meminfo); give a size ('16GiB') or a share of the experts ('25%')")
    margin = max(AUTO_MARGIN_MIN, int(AUTO_MARGIN * free))
    rows = min(total, max(free - dense_bytes - margin, 0) // row_bytes)
    dense = f" less {format_size(dense_bytes)} of dense weights" if dense_bytes else ""
    return rows, f", auto: {format_size(free)} of RAM free{dense} less a {format_size(margin)} margin"


def build_tiered(layers: list[dict[str, PartRange]], codecs: list[Codec], num_experts: int, top_k: int,
                 budget, policy, device: torch.device, direct: bool = True,
                 dense_bytes: int = 0) -> list[TieredExperts]:
    """The RAM tier for a model's expert ranges: one ``TieredExperts`` per MoE layer (bad budgets
    refused with one line before any memory is taken). ``dense_bytes``: the model's other weights
    not yet in this process's memory, which ``budget='auto'`` leaves room for."""
    total = len(layers) * num_experts
    row_bytes = sum(max(layer[p].nbytes for layer in layers) for p in layers[0])
    free = host_room()
    if budget == "auto":
        rows, why = auto_rows(free, dense_bytes, total, row_bytes)
    else:
        rows, why = host_budget_rows(budget, total, row_bytes), ""
    if rows < top_k:
        raise ValueError(f"host_budget={budget!r} holds {rows} experts of {format_size(row_bytes)}{why}, fewer "
                         f"than the top_k={top_k} one step needs; give at least {format_size(top_k * row_bytes)} "
                         f"or {100 * top_k / total:.2g}% of the experts")
    if free is not None and rows * row_bytes > free:
        raise ValueError(f"host_budget={budget!r} is {format_size(rows * row_bytes)} of experts but only "
                         f"{format_size(free)} of RAM is available; give a smaller host_budget")
    store = TieredStore(layers, num_experts, rows, policy, top_k, device.type == "cuda", direct)
    reason = (f"RAM tier of {rows} of {total} experts ({format_size(rows * row_bytes)}, "
              f"{100 * rows / total:.0f}%{why}) under {store.table.eviction_name}; the rest read from the file "
              f"({'O_DIRECT' if store.direct else 'buffered'}: {store.read_reason})")
    return [TieredExperts(store, layer, codec, reason) for layer, codec in enumerate(codecs)]
