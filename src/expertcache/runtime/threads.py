"""One CPU, two thread pools: ggml's kernels and torch's ops take turns in a decode step.

torch's CPU build runs its ops on libgomp, whose idle workers spin for a while after
each parallel region. In a decode step the torch ops between two ggml kernels (norms,
rotary, attention over one token) come every few hundred microseconds, so the workers
never sleep, and ggml's pool of as many threads finds its cores taken. Measured on
2 cores (resident Q4_K_M Qwen3-MoE, per token): the lm_head 14.4 ms with torch on 2
threads and 10.4 ms with torch on one; the experts 1.05 ms a layer on one ggml thread,
0.64 ms on ggml's two once torch is on one (1.15 ms while torch has two); decode
21.2 -> 27.8 tok/s in the same session.

So on a run whose CPU math is ggml's, a forward of few new tokens (decode) runs torch
on one thread, its ops there being tiny, and ggml on the threads torch had when the
model loaded (``ggml_threads``); a prompt keeps torch's own threads.
"""

from __future__ import annotations

import torch

from .clock import new_tokens

DECODE_TOKENS = 16   # forwards of at most this many new tokens run torch on one thread


def ggml_threads() -> int:
    """Threads for ggml's kernels: torch's count when this is asked (at load, before any
    forward has narrowed it)."""
    return torch.get_num_threads()


class DecodeThreads:
    """Forward hooks that narrow torch to one thread for decode-sized forwards and give
    the count back afterwards (also when the forward raises)."""

    def __init__(self) -> None:
        self._saved: int | None = None

    @classmethod
    def attach(cls, model: torch.nn.Module) -> DecodeThreads:
        split = cls()
        model.register_forward_pre_hook(split._before, with_kwargs=True)
        model.register_forward_hook(split._after, with_kwargs=True, always_call=True)
        return split

    def _before(self, module, args, kwargs) -> None:
        decode = (new_tokens(args, kwargs) or 1) <= DECODE_TOKENS
        if decode and self._saved is None and torch.get_num_threads() > 1:
            self._saved = torch.get_num_threads()
            torch.set_num_threads(1)

    def _after(self, module, args, kwargs, output) -> None:
        if self._saved is not None:
            torch.set_num_threads(self._saved)
            self._saved = None
