"""Batched workloads from single-stream traces: B requests decoded together (torch-free).

A server decodes many requests at once, so each engine step of a layer needs the union of
its tokens' experts. ``batch_traces`` turns traces of one stream each into a ``grouped``
trace (``trace.steps``) of ``requests`` interleaved requests: one trace's tokens cut into
B stretches, or several traces, each cut into its share of the B. Every step takes the
next token of every running request. With ``prompt`` tokens per request and a
``prompt_chunk``, requests start one after another, as vLLM's scheduler with chunked
prefill runs them: each step decodes the running requests and prefills up to
``prompt_chunk`` prompt tokens of the next waiting one, which joins the decoding once its
prompt is done.
"""

from __future__ import annotations

import numpy as np

from ..stats import DECODE, PREFILL
from .format import Trace


def cut(traces: list[Trace], requests: int,
        names: list[str] | None = None) -> list[tuple[int, int, int]]:
    """``(trace index, start, stop)`` of each request: trace ``i`` gives ``requests // n``
    stretches (the first ``requests % n`` traces one more), of equal length. ``names``: the
    traces' files, for the messages."""
    n = len(traces)
    if requests < n:
        raise ValueError(f"--requests {requests} is below the {n} traces given: each trace "
                         "gives at least one request")
    out = []
    for i, trace in enumerate(traces):
        share = requests // n + (i < requests % n)
        length = trace.num_tokens // share
        if length < 1:
            name = names[i] if names else f"trace {i}"
            raise ValueError(f"{name} has {trace.num_tokens} tokens, too few for {share} requests "
                             f"(each needs at least one token): give --requests {trace.num_tokens * n} "
                             "or fewer")
        out += [(i, r * length, (r + 1) * length) for r in range(share)]
    return out


def schedule(lengths: list[int], prompt: int, chunk: int) -> list[list[tuple[int, int]]]:
    """Steps as lists of ``(request, token index)``. Without a prompt all requests decode
    from the first step; else requests are prefilled one at a time, ``chunk`` prompt tokens
    per step, while the ones already prefilled decode."""
    pos = [0] * len(lengths)
    running: list[int] = [] if prompt else list(range(len(lengths)))
    waiting = list(range(len(lengths))) if prompt else []
    steps = []
    while running or waiting:
        step = [(r, pos[r]) for r in running]
        for r in running:
            pos[r] += 1
        if waiting:                       # the next request's prompt chunk
            r = waiting[0]
            n = min(chunk, prompt - pos[r])
            step += [(r, pos[r] + i) for i in range(n)]
            pos[r] += n
            if pos[r] >= prompt:
                waiting.pop(0)
                running.append(r)
        running = [r for r in running if pos[r] < lengths[r]]
        steps.append(step)
    return steps


def batch_traces(traces: list[Trace], requests: int, prompt: int = 0,
                 prompt_chunk: int | None = None, names: list[str] | None = None) -> Trace:
    """A ``grouped`` trace of ``requests`` requests interleaved (module doc). ``prompt``: the
    first tokens of each request are its prompt (phase 0); ``prompt_chunk`` (default: the
    whole prompt) is how many of them one step prefills. ``names``: the traces' files, for
    the messages."""
    if not traces:
        raise ValueError("batch needs at least one trace")
    if requests < 1:
        raise ValueError(f"--requests must be at least 1, got {requests}")
    for i, t in enumerate(traces):
        if t.meta.get("prefill_steps") == "grouped":  # its steps are already an engine's batches
            name = names[i] if names else f"trace {i}"
            raise ValueError(f"{name} is already a batched (grouped) trace{_requests(t)}: batching "
                             "it again would lose its batches; batch the single-stream traces it "
                             "came from")
    if prompt_chunk is not None and not prompt:
        raise ValueError(f"--prompt-chunk {prompt_chunk} needs --prompt N (the prompt tokens it "
                         "cuts into chunks); without --prompt every token decodes")
    first = traces[0]
    shape = (first.num_layers, first.num_experts, first.top_k)
    for t in traces[1:]:
        if (t.num_layers, t.num_experts, t.top_k) != shape:
            raise ValueError(f"traces differ in shape: {shape} (layers, experts, top-k) and "
                             f"{(t.num_layers, t.num_experts, t.top_k)}; batch traces of one model")
    if prompt < 0:
        raise ValueError(f"--prompt must not be negative, got {prompt}")
    chunk = prompt if prompt_chunk is None else prompt_chunk
    if prompt and chunk < 1:
        raise ValueError(f"--prompt-chunk must be at least 1, got {prompt_chunk}")
    stretches = cut(traces, requests, names)
    lengths = [stop - start for _, start, stop in stretches]
    if prompt >= min(lengths):
        raise ValueError(f"--prompt {prompt} leaves no token to decode: requests have "
                         f"{min(lengths)} tokens")
    steps = schedule(lengths, prompt, chunk)
    experts = [t.experts for t in traces]
    cols = [experts[stretches[r][0]][:, stretches[r][1] + i] for step in steps for r, i in step]
    phase = np.array([PREFILL if i < prompt else DECODE for step in steps for _, i in step],
                     np.uint8)
    meta = {**first.meta, "prefill_steps": "grouped", "step_tokens": [len(s) for s in steps],
            "batch": {"requests": requests, "traces": len(traces), "prompt": prompt,
                      "prompt_chunk": chunk if prompt else 0, "request_tokens": lengths[0]}}
    return Trace(np.stack(cols, axis=1), meta, phase=phase)


def _requests(trace: Trace) -> str:
    """' of B requests' from a batched trace's meta, else ''."""
    batch = trace.meta.get("batch")
    return f" of {batch['requests']} requests" if isinstance(batch, dict) and "requests" in batch else ""
