"""The order in which a trace's steps reach the cache (torch-free).

A step is one MoE layer's forward for one batch of tokens. Two orders exist:

- ``token``: one step per token per layer, token-major (token 0 layers 0..L-1,
  then token 1, ...). Teacher-forced and synthetic traces use it.
- ``batched``: the runtime's order. The leading prompt tokens (phase 0) run as
  one forward, so each layer sees ONE step needing the union of their experts
  (token-major, rank order, repeats dropped); every later token is one step per
  layer. Traces written by ``expertcache trace record`` say so in their meta
  (``"prefill_steps": "batched"``), and a replay in this order reproduces the
  live run's hits and misses exactly.
- ``grouped``: any grouping of consecutive tokens into steps, as an engine that batches
  requests plans them (the vLLM plug-in records such traces). Meta ``step_tokens`` lists
  the tokens of each step; a step needs the union of its tokens' experts per layer, and
  its phase is prefill when any of its tokens is a prompt token.

Either way the steps come as rows: row ``r`` holds one step per layer, so step
``s = r * L + layer`` and the layer's own step count is ``r``. The simulator's
kernels rely on that layout.
"""

from __future__ import annotations

import numpy as np

from ..stats import PREFILL
from .format import Trace

ORDERS = ("token", "batched", "grouped")


def step_order(trace: Trace, order: str | None = None) -> str:
    """``order`` checked, or the trace's own (meta ``prefill_steps``; default ``token``)."""
    if order is None:
        order = trace.meta.get("prefill_steps") if trace.meta.get("prefill_steps") in ORDERS[1:] \
            else "token"
    if order not in ORDERS:
        raise ValueError(f"unknown step order {order!r}; use one of {', '.join(ORDERS)} "
                         "(or None to follow the trace's meta 'prefill_steps')")
    if order == "grouped":
        step_tokens(trace)  # checked once, here
    return order


def step_tokens(trace: Trace) -> list[int]:
    """Tokens per step of a ``grouped`` trace (meta ``step_tokens``), checked against its length."""
    sizes = trace.meta.get("step_tokens")
    if not isinstance(sizes, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                              for n in sizes):
        raise ValueError("a 'grouped' trace needs meta 'step_tokens': a list of positive token "
                         f"counts, one per step; got {str(sizes)[:80]}")
    if sum(sizes) != trace.num_tokens:
        raise ValueError(f"meta 'step_tokens' adds up to {sum(sizes)} tokens but the trace has "
                         f"{trace.num_tokens}")
    return sizes


def prompt_tokens(trace: Trace) -> int:
    """How many leading tokens are prompt (phase 0): the runtime's one prefill forward."""
    later = np.flatnonzero(trace.phases != PREFILL)
    return int(later[0]) if later.size else trace.num_tokens


def batched_prompt(trace: Trace, order: str | None = None) -> int:
    """Prompt tokens merged into one row of steps: 0 when the order is per token or when
    the prompt has at most one token (then both orders are the same)."""
    if step_order(trace, order) == "token":
        return 0
    n = prompt_tokens(trace)
    return n if n > 1 else 0


def step_rows(trace: Trace, order: str | None = None) -> tuple[list[list[list[int]]], list[int]]:
    """``(rows, phases)``: per row, per layer the expert ids in rank order (repeats dropped),
    and each row's phase. Row 0 is the batched prompt when there is one."""
    if step_order(trace, order) == "grouped":
        return grouped_rows(trace)
    P = batched_prompt(trace, order)
    experts = trace.experts[:, P:]                          # L, T-P, K
    rows = experts.transpose(1, 0, 2).tolist()              # T-P, L, K
    srt = np.sort(experts, axis=2)
    if (srt[:, :, 1:] == srt[:, :, :-1]).any():             # repeats are rare: dedupe only then
        rows = [[list(dict.fromkeys(ex)) for ex in tok] for tok in rows]
    phases = trace.phases[P:].tolist()
    if P:
        prompt = trace.experts[:, :P].tolist()              # L, P, K
        union = [list(dict.fromkeys(e for tok in layer for e in tok)) for layer in prompt]
        rows.insert(0, union)
        phases.insert(0, PREFILL)
    return rows, phases


def grouped_rows(trace: Trace) -> tuple[list[list[list[int]]], list[int]]:
    """``step_rows`` of a ``grouped`` trace: per step, per layer the union of its tokens' experts
    (token-major, rank order, repeats dropped); a step with a prompt token is a prefill step."""
    experts = trace.experts.transpose(1, 0, 2).tolist()     # T, L, K
    phases = trace.phases.tolist()
    rows, row_phases, start = [], [], 0
    for n in step_tokens(trace):
        toks = experts[start:start + n]
        rows.append([list(dict.fromkeys(e for tok in toks for e in tok[layer]))
                     for layer in range(trace.num_layers)])
        row_phases.append(min(phases[start:start + n]))      # PREFILL (0) wins
        start += n
    return rows, row_phases


def row_keys(rows: list[list[list[int]]], num_experts: int, width: int) -> np.ndarray:
    """Step keys ``int32 [R*L, W]`` (``layer * E + expert``), -1 padding; ``W >= width``
    is the widest step. For rows that are not plain ``[L, T, K]`` token rows."""
    L = len(rows[0]) if rows else 0
    W = max([width] + [len(ex) for row in rows for ex in row])
    keys = np.full((len(rows) * L, W), -1, np.int32)
    for r, row in enumerate(rows):
        for layer, ex in enumerate(row):
            keys[r * L + layer, :len(ex)] = [layer * num_experts + e for e in ex]
    return keys
