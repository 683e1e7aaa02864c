"""The slot pool: one device tensor per weight kind ``[S, ...]``, allocated once.

Slot ids are the SlotTable's (``0..slots-1``) followed by ``staging`` slots that
stream experts a step needs but the cache does not admit. The tensors never move or
grow, so ``data_ptr()`` is fixed for the life of the model.

On CUDA, loads run on a dedicated copy stream from pinned host memory. Two kinds of
events keep it race-free without host syncs: compute waits for the copy stream
(``ready``) before reading freshly loaded slots, and a load into a slot first waits
for the compute that last read that slot (``mark_read``). On the CPU the pool is a
separate host buffer and loads are real memory copies, so the same code paths and
byte counts are exercised.
"""

from __future__ import annotations

import torch

from .compute import grouped_mm_works
from .host import HostExperts


class SlotPool:
    def __init__(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], slots: int,
                 staging: int, device: torch.device) -> None:
        if slots < 0 or staging < 0:
            raise ValueError(f"slot counts must not be negative, got slots={slots}, staging={staging}")
        self.slots, self.staging, self.device = slots, staging, torch.device(device)
        self.size = slots + staging
        # S = slots + staging; one contiguous tensor per kind so slot s of kind k is tensors[k][s]
        self.tensors = {kind: torch.zeros((self.size, *shape), dtype=dtype, device=self.device)
                        for kind, (shape, dtype) in layout.items()}
        self.cuda = self.device.type == "cuda"
        dtype = next(iter(layout.values()))[1]
        self.grouped = grouped_mm_works(self.device, dtype)  # else a loop of matmuls over used slots
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._read_done: list = [None] * self.size  # per slot: event after its last reader
        self._fresh: set[int] = set()               # slots loaded since compute last waited

    @property
    def slot_bytes(self) -> int:
        """Device memory the pool holds, staging included."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

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
            for kind, dst in self.tensors.items():
                dst[slot].copy_(host.tensors[kind][expert])
            return host.expert_bytes
        with torch.cuda.stream(self.copy_stream):
            if self._read_done[slot] is not None:  # never overwrite a slot still being read
                self.copy_stream.wait_event(self._read_done[slot])
            for kind, dst in self.tensors.items():
                dst[slot].copy_(host.tensors[kind][expert], non_blocking=True)
        self._fresh.add(slot)
        return host.expert_bytes

    def ready(self, slots=None) -> None:
        """Make compute wait for the loads into ``slots`` (all when None); no host sync.

        Only when one of them is still in flight: in the cpu miss path the copies of
        planned loads then keep running while the device computes the hits.
        """
        if self.cuda and self._fresh and (slots is None or not self._fresh.isdisjoint(slots)):
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            self._fresh.clear()  # waiting on the stream covers every copy issued so far

    def mark_read(self, slots) -> None:
        """Record that compute queued so far reads ``slots``; later loads into them wait for it."""
        if self.cuda:
            event = torch.cuda.current_stream(self.device).record_event()
            for slot in slots:
                self._read_done[slot] = event
