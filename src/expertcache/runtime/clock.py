"""Per-forward timestamps of the latest generation, taken by forward hooks on the model.

One clock per model (``ForwardClock.of(model)``) serves ``generate``, ``serve`` and
``model.expertcache.report()``, so all three measure alike. A run starts at a forward
with several new tokens (a prompt) or after ``start()``; every forward's end appends a
time and, for an offloaded model, the decode counters then (hits, accesses, H2D bytes, and
the RAM tier's hits, accesses and file bytes), so a phase's hit rates and bytes per token are
differences of two snapshots.

On CUDA the host time at a forward's end runs ahead of the device by at most the work
queued after the last MoE layer's routing read (a host sync): step-to-step intervals
stay device-true.
"""

from __future__ import annotations

import time

import torch



def new_tokens(args: tuple, kwargs: dict) -> int | None:
    """New tokens in a model forward (``input_ids`` or ``inputs_embeds`` ``[B, T, ...]``, as
    a forward pre-hook sees them), or None when neither is a batched tensor."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    return ids.shape[1] if isinstance(ids, torch.Tensor) and ids.ndim >= 2 else None


class ForwardClock:
    def __init__(self, model) -> None:
        self.model = model
        self.times: list[float] = []              # run start, then the end of each forward
        self.counters: list[tuple] = []  # ExpertCache.decode_counters() aligned with times
        self.prompt_tokens = 0
        self._restart = True

    @classmethod
    def of(cls, model) -> ForwardClock:
        """The model's clock, attached on first use."""
        clock = getattr(model, "_expertcache_clock", None)
        if clock is None:
            clock = cls(model)
            model.register_forward_pre_hook(clock._before, with_kwargs=True)
            model.register_forward_hook(clock._after, with_kwargs=True)
            model._expertcache_clock = clock
        return clock

    def start(self) -> None:
        """The next forward begins a run (a one-token prompt looks like a decode step)."""
        self._restart = True

    def _before(self, module, args, kwargs) -> None:
        new = new_tokens(args, kwargs) or 1
        if self._restart or new > 1:
            self._restart = False
            self.prompt_tokens = new
            self.times, self.counters = [time.perf_counter()], [self._snapshot()]

    def _after(self, module, args, kwargs, output) -> None:
        self.times.append(time.perf_counter())
        self.counters.append(self._snapshot())

    def _snapshot(self) -> tuple:
        cache = getattr(self.model, "expertcache", None)
        if cache is None:
            return (0,) * 6
        return cache.decode_counters()
