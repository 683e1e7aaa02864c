"""Generate with a model (offloaded or not) and measure it: what ``generate`` and ``serve`` report.

Phases: prefill is the prompt's forward (until the first new token); the decode steps
after it split as the bench splits them (``decode_phases.py``): *cold* (the first 16,
while the cache warms up), *warm* (to N/4) and *steady* (the rest). Times and counters
come from the model's ``ForwardClock`` (forward hooks), so ``generate``, ``serve`` and
``model.expertcache.report()`` measure alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decode_phases import COLD_TOKENS, bounds  # noqa: F401  (COLD_TOKENS: one definition, re-exported)
from .clock import ForwardClock
from .sampling import Sampling


@dataclass
class Generation:
    """One finished generation: the new text and tokens, why it ended, and its measurements."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str   # 'stop' (eos or a stop string), 'length' or 'cancelled'
    summary: dict


def encode(tokenizer, prompt, chat: bool = False) -> list[int]:
    """Prompt ids: plain text, or chat messages (a list of {role, content}) through the chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send plain text "
                             "(generate without --chat, or /v1/completions)")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as err:  # e.g. a template that takes no system message
            raise ValueError(f"the model's chat template refused these messages: {err}") from None
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(prompt).input_ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return list(ids)


class ContextError(ValueError):
    """A prompt plus its new tokens do not fit the model's context; ``param`` names what to change
    ('prompt' or 'max_tokens'), so the server can point at the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def context_length(model) -> int | None:
    """The model's context in tokens (``max_position_embeddings``), None when it does not say."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_context(prompt_tokens: int, new_tokens: int, context: int | None) -> None:
    """The one rule ``generate`` and ``serve`` share: the prompt and every new token fit the context."""
    if context is None:
        return
    if prompt_tokens >= context:
        raise ContextError(f"the prompt has {prompt_tokens} tokens and fills the model's context of "
                           f"{context}; shorten it", "prompt")
    if prompt_tokens + new_tokens > context:
        raise ContextError(f"the prompt's {prompt_tokens} tokens plus {new_tokens} new tokens exceed the "
                           f"model's context of {context}; ask for at most {context - prompt_tokens} "
                           "new tokens", "max_tokens")


def run_generation(model, tokenizer, ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                   on_text=None, cancelled=lambda: False) -> Generation:
    """Generate from prompt ``ids``; ``on_text(delta)`` gets text as it becomes final; ``cancelled()``
    is polled after every token and ends the run early (the model stays consistent)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from .text import StreamText

    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive whole number, got {max_new_tokens!r}")
    check_context(len(ids), max_new_tokens, context_length(model))
    stream = StreamText(tokenizer, sampling.stop)
    sink = _Sink(stream, on_text)

    class _Stop(StoppingCriteria):  # one flag per step: a stop string or the caller's cancel
        def __call__(self, input_ids, scores, **kwargs):
            done = stream.stopped or cancelled()
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    cache = getattr(model, "expertcache", None)
    before = cache.stats() if cache is not None else None
    clock = ForwardClock.of(model)
    clock.start()
    graphs = replayed(model, 1, sampling)
    with torch.no_grad():
        if graphs is not None:  # decode replayed from a captured graph (runtime/graphs.py)
            out = graphs.generate(model, torch.tensor([ids]), max_new_tokens, sampling,
                                  on_tokens=lambda tokens: sink.add(tokens),
                                  stop=lambda: stream.stopped or cancelled())
            new = out[0].tolist()
        else:
            sampling.seed_now()
            out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=max_new_tokens,
                                 streamer=sink, stopping_criteria=StoppingCriteriaList([_Stop()]),
                                 pad_token_id=tokenizer.pad_token_id, **sampling.generate_kwargs())
            new = out[0, len(ids):].tolist()
    tail = stream.finish()
    if tail and on_text:
        on_text(tail)
    reason = _finish_reason(model, new, stream.stopped, cancelled(), max_new_tokens)
    summary = summarize(clock, len(new), cache, since=before)
    return Generation(stream.text, new, len(ids), reason, summary)


def replayed(model, batch: int, sampling):
    """The model's ``DecodeGraphs`` when this generation's decode replays a captured graph, else
    None (eager ``model.generate``; ``summary()['graphs']['reason']`` then says why)."""
    cache = getattr(model, "expertcache", None)
    graphs = getattr(cache, "graphs", None)
    if graphs is None:
        return None
    why = graphs.refusal(model, batch, sampling)
    graphs.active, graphs.reason = why is None, why  # this generation's verdict
    return graphs if why is None else None


class _Sink:
    """A transformers streamer: skips the prompt, feeds each new token to StreamText."""

    def __init__(self, stream, on_text) -> None:
        self.stream, self.on_text, self.prompt_seen = stream, on_text, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.add(value.reshape(-1).tolist())

    def add(self, tokens: list[int]) -> None:
        delta = self.stream.add(tokens)
        if delta and self.on_text:
            self.on_text(delta)

    def end(self) -> None:
        pass


def _finish_reason(model, new: list[int], stopped: bool, cancelled: bool, limit: int) -> str:
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if stopped or (new and new[-1] in eos):
        return "stop"
    return "cancelled" if cancelled and len(new) < limit else "length"


def generate_and_measure(model, tokenizer, prompt, max_new_tokens: int, sampling: Sampling = Sampling(),
                         chat: bool = False, on_text=None) -> tuple[str, dict]:
    """Generate from a prompt (text, or chat messages with ``chat``); returns the text and a summary."""
    gen = run_generation(model, tokenizer, encode(tokenizer, prompt, chat), max_new_tokens, sampling, on_text)
    return gen.text, gen.summary


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens and seconds > 0 else None


def summarize(clock: ForwardClock, new_tokens: int, cache, since=None) -> dict:
    """Speeds per phase from the clock, plus the cache's counters (``since`` a stats snapshot)."""
    times, counters = clock.times, clock.counters
    prefill_s = times[1] - times[0] if len(times) > 1 else 0.0
    steps = [b - a for a, b in zip(times[1:], times[2:])]  # decode steps after the first token
    summary = {"prompt_tokens": clock.prompt_tokens, "new_tokens": new_tokens,
               "prefill": {"seconds": prefill_s, "tok_s": _rate(clock.prompt_tokens, prefill_s)}}
    for name, idx in bounds(len(steps)).items():
        seconds = sum(steps[i] for i in idx)
        part = {"tokens": len(idx), "seconds": seconds, "tok_s": _rate(len(idx), seconds)}
        if cache is not None:  # step i runs between snapshots i+1 and i+2
            hits, accesses, h2d, ram_hits, ram_accesses, file_bytes = (
                b - a for a, b in zip(counters[idx.start + 1], counters[idx.stop + 1]))
            part.update(hit_rate=hits / accesses if accesses else None,
                        h2d_bytes_per_token=h2d / len(idx) if len(idx) else None)
            if getattr(cache, "tier", None) is not None:  # host_memory='tiered': the RAM tier's share
                part.update(ram_hit_rate=ram_hits / ram_accesses if ram_accesses else None,
                            file_bytes_per_token=file_bytes / len(idx) if len(idx) else None)
        summary[f"decode_{name}"] = part
    if cache is not None:
        summary["cache"] = _cache_part(cache, len(steps), new_tokens, since)
    return summary


def _cache_part(cache, decode_steps: int, new_tokens: int, since) -> dict:
    stats = cache.stats() if since is None else cache.stats().since(since)
    return {"hit_rate": stats.total().hit_rate,
            "hit_rate_prefill": stats.total("prefill").hit_rate,
            "hit_rate_decode": stats.total("decode").hit_rate,
            "h2d_bytes": stats.h2d_bytes(),
            "h2d_bytes_per_decode_token": stats.h2d_bytes("decode") / decode_steps if decode_steps else None,
            "h2d_bytes_per_new_token": stats.h2d_bytes() / max(new_tokens, 1),
            **cache.summary(),
            "stats": stats.to_dict()}


def format_summary(summary: dict) -> str:
    """Human-readable lines for the terminal."""
    from ..sizes import format_size

    def phase(name):
        part = summary[f"decode_{name}"]
        text = f"{part['tokens']} tokens, " + ("-" if part["tok_s"] is None else f"{part['tok_s']:.1f} tok/s")
        if part.get("hit_rate") is not None:
            text += f", hit rate {part['hit_rate']:.3f}, H2D {format_size(part['h2d_bytes_per_token'])}/token"
        if part.get("ram_hit_rate") is not None:
            text += (f", RAM hits {part['ram_hit_rate']:.3f}, "
                     f"{format_size(part['file_bytes_per_token'])}/token from the file")
        return text

    pre = summary["prefill"]["tok_s"]
    rows = [("prefill", f"{summary['prompt_tokens']} tokens, " + ("-" if pre is None else f"{pre:.1f} tok/s")),
            ("decode cold", phase("cold")), ("decode warm", phase("warm")), ("decode steady", phase("steady"))]
    c = summary.get("cache")
    if c:
        per_tok = c["h2d_bytes_per_decode_token"]
        rows += [("hit rate", f"{c['hit_rate']:.3f} (prefill {c['hit_rate_prefill']:.3f}, "
                              f"decode {c['hit_rate_decode']:.3f})"),
                 ("H2D", f"{format_size(c['h2d_bytes'])} total, "
                         f"{'-' if per_tok is None else format_size(per_tok)} per decode token"),
                 ("slot pool", f"{c['slots']} slots + {c['staging']} staging = "
                               f"{format_size(c['slot_bytes'])} on {c['device']} "
                               f"({format_size(c['bytes_per_slot'])} per slot, {format_size(c['expert_bytes'])} "
                               f"per load{', ' + '/'.join(c['quant']) + ' in ' + c['slot_format'] + ' slots' if c['quant'] else ''})"),
                 ("host experts", f"{c['host_memory']}: {c['host_memory_reason']}"),
                 ("planner", planner_line(c)),
                 ("policy", policy_label(c["config"]))]
        capped = slots_note(c)
        if capped:
            rows.insert(-3, ("", capped))  # under the slot pool line
        if c.get("graphs"):
            rows.append(("graphs", graphs_label(c["graphs"])))
        if c.get("tier"):  # host_memory='tiered' (runtime/tiered.py)
            rows.append(("RAM tier", tier_line(c["tier"])))
    return "\n".join(f"{label:<14}{value}" for label, value in rows)


def graphs_label(graphs: dict) -> str:
    """'on (cuda-graph): 31 replays, 0 breaks, batch sizes 1', or 'off, eager decode: why'."""
    if graphs["active"]:
        return (f"{graphs['mode']} ({graphs['how']}): {graphs['replays']} replays, {graphs['breaks']} breaks, "
                f"batch sizes {', '.join(map(str, graphs['captured']))}")
    return f"{graphs['mode']}, eager decode: {graphs['reason']}"


def planner_line(cache: dict) -> str:
    """Which planner runs decode steps and why (``ExpertCache.summary()``): a refused
    ``planner='device'`` says so here, not only in the JSON."""
    return f"{cache['planner']} ({cache['planner_reason']})"


def slots_note(cache: dict) -> str | None:
    """Why the pool has fewer cache slots than ``--slots`` asked, or None."""
    asked = cache["config"].get("slots")
    if asked is None or asked <= cache["slots"] or cache.get("host_resident"):
        return None
    total = cache["layers"] * cache["experts"]
    why = (f"the model has {total} experts ({cache['layers']} x {cache['experts']}): more slots would "
           "only waste memory") if asked > total else \
        f"a per-layer partition takes whole slots per layer ({cache['slots'] // cache['layers']} each)"
    return f"--slots {asked} asked, {cache['slots']} used: {why}"


def tier_line(tier: dict) -> str:
    """The RAM tier's decode counters in one line (``TieredStore.stats()``)."""
    from ..sizes import format_size

    d = tier["decode"]
    rate = f"{d['ram_hits'] / d['accesses']:.3f}" if d["accesses"] else "-"
    return (f"{tier['rows']} experts ({format_size(tier['bytes'])}), {tier['policy']}; decode RAM hit rate "
            f"{rate}, {d['file_reads']} experts read, {format_size(d['file_bytes_per_token'])} per token in "
            f"{d['read_seconds']:.2f} s, {d.get('wait_seconds', 0):.2f} s waited ({tier['reads']}, "
            f"{tier['reader']})")


def policy_label(config: dict) -> str:
    """'slru:protected=0.5+second-hit', the syntax --policy takes (parameters as configured)."""
    def side(name, params):
        return ":".join([name, *(f"{k}={v}" for k, v in params.items())])
    return f"{side(config['eviction'], config['eviction_params'])}+" \
           f"{side(config['admission'], config['admission_params'])}"


class Report(dict):
    """A summary (JSON-ready dict) that prints as the ``generate`` table."""

    def __str__(self) -> str:
        return format_summary(self)

    def __repr__(self) -> str:
        return format_summary(self)


def report(model) -> Report:
    """The latest generation's phases and speeds, with the cache's counters since its last reset."""
    clock = ForwardClock.of(model)
    if len(clock.times) < 2:
        raise ValueError("no generation measured yet: run model.generate(...) first")
    return Report(summarize(clock, len(clock.times) - 1, getattr(model, "expertcache", None)))
