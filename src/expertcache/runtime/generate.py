"""Generate with an offloaded model and measure it: the numbers ``expertcache generate`` prints.

Phases: prefill is the prompt's forward (until the first new token); decode steps
are the tokens after it, split into *cold* (the first 16, while the cache warms up)
and *steady* (the rest). Per-token timestamps come from a streamer: generate hands it
each token after moving it to the host, so device work is finished by then.
"""

from __future__ import annotations

import time

from ..decode_phases import COLD_TOKENS


class _Clock:
    """A transformers streamer that only timestamps: put(prompt) first, then put(token) per step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_and_measure(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[str, dict]:
    """Greedy generation; returns the new text and a JSON-ready summary."""
    import torch

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive whole number, got {max_new_tokens!r}")
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    if ids.shape[1] == 0:
        raise ValueError("the prompt encodes to no tokens")
    cache = getattr(model, "expertcache", None)
    if cache is not None:
        cache.reset_stats()
    clock = _Clock()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, streamer=clock,
                             pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True)
    return text, summarize(clock.times, ids.shape[1], len(new), cache)


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens and seconds > 0 else None


def summarize(times: list[float], prompt_tokens: int, new_tokens: int, cache) -> dict:
    """Speeds from streamer timestamps plus the cache's counters."""
    prefill_s = times[1] - times[0] if len(times) > 1 else 0.0
    steps = [b - a for a, b in zip(times[1:], times[2:])]  # decode steps after the first token
    cold, steady = steps[:COLD_TOKENS], steps[COLD_TOKENS:]
    summary = {
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "prefill": {"seconds": prefill_s, "tok_s": _rate(prompt_tokens, prefill_s)},
        "decode_cold": {"tokens": len(cold), "seconds": sum(cold), "tok_s": _rate(len(cold), sum(cold))},
        "decode_steady": {"tokens": len(steady), "seconds": sum(steady),
                          "tok_s": _rate(len(steady), sum(steady))},
    }
    if cache is not None:
        stats = cache.stats()
        decode_steps = max(len(steps), 1)
        summary["cache"] = {
            "hit_rate": stats.total().hit_rate,
            "hit_rate_prefill": stats.total("prefill").hit_rate,
            "hit_rate_decode": stats.total("decode").hit_rate,
            "h2d_bytes": stats.h2d_bytes(),
            "h2d_bytes_per_decode_token": stats.h2d_bytes("decode") / decode_steps if steps else None,
            "h2d_bytes_per_new_token": stats.h2d_bytes() / max(new_tokens, 1),
            **cache.summary(),
            "stats": stats.to_dict(),
        }
    return summary


def format_summary(summary: dict) -> str:
    """Human-readable lines for the terminal."""
    from ..sizes import format_size

    def rate(part):
        value = summary[part]["tok_s"]
        return "-" if value is None else f"{value:.1f} tok/s"

    c = summary.get("cache")
    rows = [("prefill", f"{summary['prompt_tokens']} tokens, {rate('prefill')}"),
            ("decode cold", f"{summary['decode_cold']['tokens']} tokens, {rate('decode_cold')}"),
            ("decode steady", f"{summary['decode_steady']['tokens']} tokens, {rate('decode_steady')}")]
    if c:
        per_tok = c["h2d_bytes_per_decode_token"]
        rows += [("hit rate", f"{c['hit_rate']:.3f} (prefill {c['hit_rate_prefill']:.3f}, "
                              f"decode {c['hit_rate_decode']:.3f})"),
                 ("H2D", f"{format_size(c['h2d_bytes'])} total, "
                         f"{'-' if per_tok is None else format_size(per_tok)} per decode token"),
                 ("slot pool", f"{c['slots']} slots + {c['staging']} staging = "
                               f"{format_size(c['slot_bytes'])} on {c['device']} "
                               f"(expert {format_size(c['expert_bytes'])}"
                               f"{', ' + '/'.join(c['quant']) + ' in ' + c['slot_format'] + ' slots' if c['quant'] else ''})"),
                 ("host experts", f"{c['host_memory']}: {c['host_memory_reason']}")]
    lines = [f"{label:<14}{value}" for label, value in rows]
    return "\n".join(lines)
