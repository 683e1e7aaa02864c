"""Cache and speed figures for ``/v1/expertcache/stats`` and each answer's ``usage.expertcache``.

The counters are the cache's own (``model.expertcache.stats()``, cumulative since the
server started); speeds are the per-request summaries of ``runtime.generate`` summed
per phase, so "since start" tok/s is total tokens over total seconds of that phase.
"""

from __future__ import annotations

import threading
import time

from ..decode_phases import PHASES
from ..runtime.generate import Generation, policy_label


class Telemetry:
    def __init__(self, model) -> None:
        self.cache = getattr(model, "expertcache", None)
        self.started = time.time()
        self.lock = threading.Lock()
        self.requests = self.prompt_tokens = self.completion_tokens = 0
        self.phases = {name: [0, 0.0] for name in ("prefill", *PHASES)}  # tokens, seconds
        self.last: dict | None = None

    def add(self, gen: Generation) -> None:
        """Called by the worker after each generation, before its client hears of it."""
        s = gen.summary
        with self.lock:
            self.requests += 1
            self.prompt_tokens += gen.prompt_tokens
            self.completion_tokens += len(gen.token_ids)
            self.phases["prefill"][0] += s["prompt_tokens"]
            self.phases["prefill"][1] += s["prefill"]["seconds"]
            for name in PHASES:
                self.phases[name][0] += s[f"decode_{name}"]["tokens"]
                self.phases[name][1] += s[f"decode_{name}"]["seconds"]
            self.last = usage_block(s)

    def snapshot(self) -> dict:
        with self.lock:
            out = {"uptime_s": time.time() - self.started, "requests": self.requests,
                   "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                   "since_start": {name: _rate(*tn) for name, tn in self.phases.items()},
                   "last_request": self.last}
        if self.cache is None:
            return {**out, "cache": None}
        stats = self.cache.stats()
        decode_steps = sum(self.phases[name][0] for name in PHASES)
        info = self.cache.summary()
        out["cache"] = {"policy": policy_label(info["config"]), "slots": info["slots"],
                        "staging": info["staging"], "slot_bytes": info["slot_bytes"],
                        "expert_bytes": info["expert_bytes"], "device": info["device"],
                        "hit_rate": stats.total().hit_rate, "hit_rate_decode": stats.total("decode").hit_rate,
                        "h2d_bytes": stats.h2d_bytes(),
                        "h2d_bytes_per_decode_token": stats.h2d_bytes("decode") / decode_steps
                        if decode_steps else None,
                        "stats": stats.to_dict()}
        return out


def _rate(tokens: int, seconds: float) -> dict:
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if tokens and seconds > 0 else None}


def usage_block(summary: dict) -> dict:
    """The short per-request block: speeds per phase, this request's hit rate and H2D per token."""
    block = {"prefill_tok_s": summary["prefill"]["tok_s"],
             **{f"decode_{name}_tok_s": summary[f"decode_{name}"]["tok_s"] for name in PHASES}}
    cache = summary.get("cache")
    if cache is not None:
        block.update(hit_rate=cache["hit_rate"], hit_rate_decode=cache["hit_rate_decode"],
                     h2d_bytes=cache["h2d_bytes"], h2d_bytes_per_decode_token=cache["h2d_bytes_per_decode_token"],
                     policy=policy_label(cache["config"]), slots=cache["slots"])
    return block
