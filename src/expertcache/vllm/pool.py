"""Host experts and the device slot pool, in the layout vLLM's experts kernel reads.

A cached layer's ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I] are created on the
host (pinned when CUDA is there) by vLLM's own ``create_weights``, run under a host
device context (``create_on_host``); vLLM loads the checkpoint into them and repacks
them there in ``process_weights_after_loading`` (on the CPU: I padded to a multiple of
32 and each expert prepacked on its own; on CUDA's Triton path: no repacking). Then they
become the host store, and every MoE layer holds one shared pool instead, the only
expert memory on the device: ``[S + staging, ...]`` per weight kind, allocated once
(fixed addresses), the same ``Parameter`` object in every layer. A slot is a row of
dimension 0, so copying expert ``e``'s rows into slot ``s`` and remapping ids ``e -> s``
is all the kernel needs (each expert is packed independently; CONTEXT.md: bit-identical
on the CPU).
"""

from __future__ import annotations

import torch

KINDS = ("w13_weight", "w2_weight")  # the per-expert tensors of an unquantized layer
HOST = torch.device("cpu")
HOST_MARK = "_expertcache_host"      # set on the expert parameters create_on_host made


def create_on_host(quant_method) -> None:
    """Make ``quant_method.create_weights`` put the expert tensors on the host, and keep
    vLLM from moving them to the device for repacking.

    vLLM builds the model under a device context (every ``torch.empty`` lands on the
    GPU); this runs vLLM's own ``create_weights`` under a host context instead, then
    gives each expert tensor pinned memory on CUDA (``torch.empty`` reserves pages
    without touching them, so the first allocation costs nothing). vLLM's loader moves
    CPU parameters to the device around ``process_weights_after_loading`` unless
    ``requires_device_loading`` is false: the repacking then runs where the experts
    live, on the host.
    """
    original = quant_method.create_weights

    def create_weights(layer, *args, **kwargs):
        with torch.device(HOST):
            original(layer, *args, **kwargs)
        pin = torch.cuda.is_available()
        for kind in KINDS:
            param = getattr(layer, kind)
            if pin and not param.data.is_pinned():
                param.data = torch.empty_like(param.data, device=HOST, pin_memory=True)
            setattr(param, HOST_MARK, True)

    quant_method.create_weights = create_weights
    quant_method.requires_device_loading = False


def check_pool_fits(pool_bytes: int, device: torch.device, free_bytes: int | None = None) -> None:
    """ValueError, before allocating, when the pool is larger than the device's free memory."""
    if free_bytes is None:
        free_bytes = device_free_bytes(device)
    if free_bytes is not None and pool_bytes > free_bytes:
        raise ValueError(f"expertcache: the slot pool needs {pool_bytes / 2**30:.2f} GiB on {device} "
                         f"but only {free_bytes / 2**30:.2f} GiB are free while loading; lower 'slots' or "
                         "'gpu_memory' (vLLM sizes its KV cache from what is left after it)")


def device_free_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            import psutil
        except ImportError:
            return None
        return psutil.virtual_memory().available
    return None


class HostExperts:
    """One layer's experts in host memory: kind -> [E, ...] (pinned when CUDA is there)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.num_experts = next(iter(tensors.values())).shape[0]
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in tensors.values())

    @classmethod
    def take(cls, layer: torch.nn.Module) -> HostExperts:
        """``layer``'s loaded, repacked expert tensors, which create_on_host put on the host.

        Repacking may have made new tensors (the CPU's padding and prepacking): on CUDA
        they are pinned here, once, so that copies from them run asynchronously.
        """
        out = {}
        for kind in KINDS:
            t = getattr(layer, kind).data
            if t.device.type != HOST.type:
                raise ValueError(f"expertcache: {layer.layer_name}.{kind} is on {t.device} after loading; "
                                 "the plug-in creates experts on the host (pool.create_on_host): "
                                 "another plug-in or loader moved them")
            if torch.cuda.is_available() and not t.is_pinned():
                t = t.pin_memory()
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
        self.rows = slots + staging  # the expert count the kernel is called with: ids < rows
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
