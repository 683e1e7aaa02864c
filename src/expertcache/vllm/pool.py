"""Host experts and the device slot pool, in the layout vLLM's experts kernel reads.

After vLLM's ``process_weights_after_loading`` (on the CPU: I padded to a multiple of
32 and each expert prepacked on its own), a layer's ``w13_weight`` [E, 2I, H] and
``w2_weight`` [E, H, I] move to the host store; every MoE layer then holds one shared
pool instead: ``[S + staging, ...]`` per weight kind, allocated once (fixed addresses),
the same ``Parameter`` object in every layer. A slot is a row of dimension 0, so copying
expert ``e``'s rows into slot ``s`` and remapping ids ``e -> s`` is all the kernel needs
(each expert is packed independently; CONTEXT.md: bit-identical on the CPU).
"""

from __future__ import annotations

import torch

KINDS = ("w13_weight", "w2_weight")  # the per-expert tensors of an unquantized layer


class HostExperts:
    """One layer's experts in host memory: kind -> [E, ...] (pinned when CUDA is there)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.num_experts = next(iter(tensors.values())).shape[0]
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in tensors.values())

    @classmethod
    def take(cls, layer: torch.nn.Module) -> HostExperts:
        """Move ``layer``'s loaded, repacked expert tensors to the host (no copy on the CPU)."""
        out = {}
        for kind in KINDS:
            t = getattr(layer, kind).data
            if t.device.type != "cpu":
                t = t.to("cpu").pin_memory()  # the device copy is freed when the pool replaces it
            out[kind] = t
        return cls(out)

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(t.shape[1:]), t.dtype) for k, t in self.tensors.items()}


class SlotPool:
    """``kind -> [slots + staging, ...]`` on ``device``; loads on a copy stream on CUDA.

    Slots ``0..slots-1`` are the SlotTable's; ``slots..slots+staging-1`` stage the experts
    a step needs beyond what the cache admits (SlotTable bypasses).
    """

    def __init__(self, layout: dict, slots: int, staging: int, device: torch.device) -> None:
        self.slots, self.staging, self.device = slots, staging, torch.device(device)
        self.params = {k: torch.nn.Parameter(torch.zeros((slots + staging, *shape), dtype=dtype,
                                                         device=self.device), requires_grad=False)
                       for k, (shape, dtype) in layout.items()}
        self.layout = layout
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending = False

    @property
    def staging_ids(self) -> list[int]:
        return list(range(self.slots, self.slots + self.staging))

    @property
    def slot_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def begin(self) -> None:
        """Before a step's loads: copies must wait for kernels still reading the slots."""
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def load(self, slot: int, host: HostExperts, expert: int) -> int:
        """Copy ``expert``'s rows into ``slot``; returns the bytes moved."""
        if self.cuda:
            with torch.cuda.stream(self._stream):
                for kind, p in self.params.items():
                    p.data[slot].copy_(host.tensors[kind][expert], non_blocking=True)
            self._pending = True
        else:
            for kind, p in self.params.items():
                p.data[slot].copy_(host.tensors[kind][expert])
        return host.expert_bytes

    def ready(self) -> None:
        """Make the compute stream wait for the copies issued so far (one event per step)."""
        if self.cuda and self._pending:
            event = torch.cuda.Event()
            event.record(self._stream)
            torch.cuda.current_stream(self.device).wait_event(event)
            self._pending = False
