"""The slot pool: one device tensor per weight kind ``[S, ...]``, allocated once.

Slot ids are the SlotTable's (``0..slots-1``) followed by ``staging`` slots that
stream experts a step needs but the cache does not admit. The tensors never move or
grow, so ``data_ptr()`` is fixed for the life of the model.

Quantized experts (``runtime/quantized.py``) come in two slot formats: ``quantized``
slots hold the stored bytes and ``view()`` dequantizes the slots a step reads into a
scratch of the compute dtype; ``dequantized`` slots hold the compute dtype and
``load()`` copies the bytes into a small device buffer, then dequantizes into the slot.
Either way only the quantized bytes cross from the host. On CUDA with Triton the fused kernel
(``runtime/fused.py``, ``fused_layout``) reads quantized slots' bytes in place instead of
``view()``: no scratch.

On CUDA, loads run on a dedicated copy stream from pinned host memory. Events keep it
race-free without host syncs: each load records one, and compute reading freshly loaded
slots waits only for the loads into those slots (``ready``), so hits never wait for the
copies of misses; a load into a slot first waits for the compute that last read that
slot (``mark_read``); and the copy stream starts behind the pool's zero-fill. On the CPU the pool is a
separate host buffer and loads are real memory copies, so the same code paths and
byte counts are exercised.
"""

from __future__ import annotations

import torch

from typing import TYPE_CHECKING

from ..config import SLOT_KINDS
from . import fused
from .compute import grouped_mm_works
from .host import HostExperts

if TYPE_CHECKING:
    from .quantized import Codec


class SlotPool:
    def __init__(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], slots: int,
                 staging: int, device: torch.device, codecs: list[Codec] | None = None,
                 slot_format: str = "plain", scratch: int = 0) -> None:
        if slots < 0 or staging < 0:
            raise ValueError(f"slot counts must not be negative, got slots={slots}, staging={staging}")
        if slot_format not in SLOT_KINDS or (slot_format == "plain") != (not codecs):
            raise ValueError(f"slot format {slot_format!r} with codecs {codecs!r}")
        self.slots, self.staging, self.device = slots, staging, torch.device(device)
        self.size = slots + staging
        # every layer's codec computes the same weights; their stored types may differ by layer
        # (llama.cpp's Q4_K_M: Q6_K down in half the layers), so byte slots fit the largest
        self.codec, self.format = (codecs[0] if codecs else None), slot_format
        if slot_format == "quantized":
            layout = _largest(codecs)
        elif slot_format == "dequantized":
            layout = self.codec.compute_layout()
            # one expert's bytes on the device, between the copy and the dequantization
            self._landing = {k: torch.empty(shape, dtype=dtype, device=self.device)
                             for k, (shape, dtype) in _largest(codecs).items()}
        # S = slots + staging; one contiguous tensor per kind so slot s of kind k is tensors[k][s]
        self.tensors = {kind: torch.zeros((self.size, *shape), dtype=dtype, device=self.device)
                        for kind, (shape, dtype) in layout.items()}
        # most experts one view() dequantizes at once (quantized slots): the scratch size
        # (None: no limit, also when ggml computes on the quantized slots and needs no scratch)
        self.max_view = (scratch or None) if slot_format == "quantized" else None
        self.cuda = self.device.type == "cuda"
        dtype = self.codec.dtype if self.codec is not None else next(iter(layout.values()))[1]
        self.grouped = grouped_mm_works(self.device, dtype)  # else a loop of matmuls over used slots
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        if self.cuda:  # the zero-fill above ran on the compute stream: no copy may overtake it
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._read_done: list = [None] * self.size  # per slot: event after its last reader
        # slot -> (load number, event recorded after its copy): loads compute has not waited for
        self._fresh: dict[int, tuple[int, object]] = {}
        self._loads = 0

    @property
    def slot_bytes(self) -> int:
        """Device memory the pool holds, staging included (not the per-step scratch)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def scratch_bytes(self) -> int:
        """Most device memory one step's dequantization scratch takes (quantized slots)."""
        return (self.max_view or 0) * self.codec.compute_bytes if self.codec is not None else 0

    @property
    def staging_ids(self) -> range:
        return range(self.slots, self.size)

    def data_ptrs(self) -> dict[str, int]:
        return {k: t.data_ptr() for k, t in self.tensors.items()}

    def load(self, slot: int, host: HostExperts, expert: int) -> int:
        """Copy one expert from host memory into ``slot``; returns the bytes moved."""
        if not 0 <= slot < self.size:
            raise IndexError(f"slot {slot} outside the pool of {self.size} slots")
        if not self.cuda:
            self._copy(slot, host, expert)
            return host.expert_bytes
        with torch.cuda.stream(self.copy_stream):
            if self._read_done[slot] is not None:  # never overwrite a slot still being read
                self.copy_stream.wait_event(self._read_done[slot])
            self._copy(slot, host, expert)
            self._loads += 1
            self._fresh[slot] = (self._loads, self.copy_stream.record_event())
        return host.expert_bytes

    def _copy(self, slot: int, host: HostExperts, expert: int) -> None:
        """The copy itself (on the copy stream with CUDA; stream order keeps _landing safe)."""
        if self.format == "plain":
            for kind, dst in self.tensors.items():
                dst[slot].copy_(host.tensors[kind][expert], non_blocking=self.cuda)
            return
        dst = self.tensors if self.format == "quantized" else self._landing
        for part, src in host.tensors.items():  # a layer's bytes may be fewer than the slot's
            row = dst[part][slot] if self.format == "quantized" else dst[part]
            row[:src.shape[1]].copy_(src[expert], non_blocking=self.cuda)
        if self.format == "dequantized":
            size = host.codec.part
            decoded = host.codec.decode({k: t[:size[k].nbytes].unsqueeze(0) for k, t in self._landing.items()})
            for kind, weights in decoded.items():
                self.tensors[kind][slot].copy_(weights[0])

    def fused_layout(self, module: torch.nn.Module, host: HostExperts) -> fused.Layout | None:
        """The fused kernel's view of the slots for ``module`` (``runtime/fused.py``), or None where
        the torch path computes them (``kernel_report`` says why)."""
        layout = self._layout(module, host)
        return layout if isinstance(layout, fused.Layout) else None

    def _layout(self, module: torch.nn.Module, host: HostExperts) -> fused.Layout | str:
        quantized = self.format == "quantized"  # dequantized slots: float, always [out, in]
        return fused.layout_for(module, self.tensors, host.codec if quantized else None,
                                False if self.format == "dequantized" else host.transposed)

    def kernel_report(self, module: torch.nn.Module | None, host: HostExperts) -> tuple[str, str]:
        """(the kernel that computes on these slots, why): ``fused.NAME`` or the torch path."""
        torch_path = ("grouped_mm" if self.grouped else "matmul loop") + \
            (" on dequantized scratch" if self.format == "quantized" else "")
        if module is None:
            return torch_path, "no experts module seen yet"
        layout = self._layout(module, host)
        if isinstance(layout, str):
            return torch_path, layout
        return fused.NAME, ("Triton kernel over the slots, pairs sorted into blocks on the device: "
                            + ("quantized bytes decoded in place, no scratch" if self.format == "quantized"
                               else "weights read in place"))

    def view(self, mapping: dict[int, int], host: HostExperts) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
        """Compute weights for the experts in ``mapping`` (expert -> slot), and expert -> row in them.

        Plain and dequantized slots: the pool itself, rows = slots (no copy). Quantized
        slots: the used slots dequantized with their layer's codec into a fresh scratch
        [n, ...], n <= max_view. On a GPU in one batch; on the CPU slot by slot, which
        stays in cache (measured 4x faster for 8 Qwen3 Q4_K experts).
        """
        if self.format != "quantized":
            return self.tensors, mapping
        used, codec = sorted(set(mapping.values())), host.codec
        size = codec.part  # this layer's bytes per part: a prefix of each (largest-sized) slot
        if self.cuda:
            index = torch.tensor(used).pin_memory().to(self.device, non_blocking=True)  # no stream sync
            scratch = codec.decode({k: t.index_select(0, index)[:, :size[k].nbytes] for k, t in self.tensors.items()})
        else:
            each = [codec.decode({k: t[s:s + 1, :size[k].nbytes] for k, t in self.tensors.items()}) for s in used]
            scratch = {k: torch.cat([e[k] for e in each]) for k in each[0]}
        row = {slot: i for i, slot in enumerate(used)}
        return scratch, {expert: row[slot] for expert, slot in mapping.items()}

    def ready(self, slots=None) -> None:
        """Make compute wait for the loads into ``slots`` (all when None); no host sync.

        Only for loads still unwaited, and only up to the latest of them: copies of other
        slots (a step's misses, a later round's staging) keep running while the device
        computes what is resident.
        """
        if not self._fresh:
            return
        wanted = self._fresh.keys() if slots is None else self._fresh.keys() & set(slots)
        if not wanted:
            return
        latest, event = max(self._fresh[s] for s in wanted)
        torch.cuda.current_stream(self.device).wait_event(event)
        # the copy stream runs in order: every load up to the latest one is covered
        self._fresh = {s: le for s, le in self._fresh.items() if le[0] > latest}

    def mark_read(self, slots) -> None:
        """Record that compute queued so far reads ``slots``; later loads into them wait for it."""
        if self.cuda:
            event = torch.cuda.current_stream(self.device).record_event()
            for slot in slots:
                self._read_done[slot] = event


def _largest(codecs: list[Codec]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Byte layout that holds any layer's expert: each part at its largest size."""
    return {name: ((max(c.part[name].nbytes for c in codecs),), torch.uint8) for name in codecs[0].part}

