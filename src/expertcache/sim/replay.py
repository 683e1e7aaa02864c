"""Replay a routing trace through ``SlotTable``: the simulator's ground truth.

Semantics (docs/simulator.md): cold start; steps run token-major (token 0 layers
0..L-1, then token 1, ...); every access is counted; a hit is a key resident
when its step begins; the phase comes from the trace. A recorded trace (meta
``prefill_steps: batched``) replays its prompt as one step per layer, the
union of the prompt tokens' experts, as the live run planned it
(``trace.steps``); the kernels take such steps padded to the widest. ``belady`` is the exact
optimum with forced admission: the table is handed a ``Future`` built from the
same steps. The table is the runtime's own code, so simulated and live hit
rates cannot drift apart. A built-in policy's logic is its compiled kernel
(``policies.kernels``: one step, one module of hooks per policy), which the table
runs one step per call and the simulator here a whole trace per call (``run_kernel``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..cache import SlotTable, partition_shares
from ..policies.belady import Future
from ..config import fraction_slots
from ..policies.registry import PolicyPair, admission_spec, eviction_spec, own_admission, parse_policy
from ..stats import PREFILL, Counts, Stats
from ..trace.format import Trace

ENGINES = ("auto", "table", "fast")


@dataclass
class ReplayResult:
    """One policy at one size on one trace; ``stats`` has per-layer, per-phase counts."""

    policy: str        # eviction policy as registered (what actually ran)
    admission: str
    partition: str
    slots: int         # total slots (per-layer: ``slots // L`` each)
    stats: Stats
    engine: str        # "table" (SlotTable) or the fast kernel used
    label: str = ""    # what the user asked for, e.g. "default" -> "default (next-use+freq)"
    spec: ReplayPolicy | None = None  # the policies as run, with their parameters

    @property
    def total(self) -> Counts:
        return self.stats.total()

    @property
    def accesses(self) -> int:
        return self.total.accesses

    @property
    def hits(self) -> int:
        return self.total.hits

    @property
    def misses(self) -> int:
        return self.total.misses

    @property
    def hit_rate(self) -> float:
        return self.total.hit_rate


@dataclass(frozen=True)
class ReplayPolicy:
    """``EVICTION[:k=v][+ADMISSION[:k=v]]`` resolved once: both ``PolicySpec``s (classes and
    checked parameters) and the label to show for it."""

    spec: PolicyPair
    label: str

    @property
    def eviction(self) -> str:
        return self.spec.eviction.name

    @property
    def admission(self) -> str:
        return self.spec.admission.name

    @property
    def eviction_cls(self) -> type:
        return self.spec.eviction.cls

    @property
    def admission_cls(self) -> type:
        return self.spec.admission.cls

    @property
    def eviction_params(self) -> dict:
        return self.spec.eviction.params

    @property
    def admission_params(self) -> dict:
        return self.spec.admission.params

    def policy(self, capacity: int):
        """A fresh eviction policy of this spec."""
        return self.spec.eviction.build(capacity)

    def __str__(self) -> str:
        return self.label


def resolve_policy(spec: str | PolicyPair | ReplayPolicy, eviction_params: dict | None = None,
                   admission_params: dict | None = None, label: str | None = None) -> ReplayPolicy:
    """Parse a spec (``slru:protected=0.5+second-hit``) or take resolved ``PolicySpec``s; names
    are looked up (ValueError lists the known ones) and parameters checked once; explicit
    ``*_params`` win over the spec's own. ``default`` is labelled with the policy it stands for."""
    if isinstance(spec, ReplayPolicy) and eviction_params is None and admission_params is None:
        return spec
    if isinstance(spec, ReplayPolicy):
        spec, label = spec.spec, label or spec.label
    pair = parse_policy(spec) if isinstance(spec, str) else spec
    if eviction_params is not None or admission_params is not None:
        pair = PolicyPair(eviction_spec(pair.eviction.name, eviction_params),
                          admission_spec(pair.admission.name, admission_params))
    label = label or (spec.strip() if isinstance(spec, str) else str(pair))
    if pair.eviction.name == "default":
        # 'default' names the policy it stands for, and the admission it brings when none is named
        own = admission_spec(own_admission(pair.eviction.cls))
        own = f"+{own.name}" if own == pair.admission and "+" not in label else ""
        label = label.replace("default", f"default ({_aliased(pair.eviction.cls)}{own})", 1)
    return ReplayPolicy(pair, label)


def _aliased(cls) -> str:
    """The registered policy an alias class stands for (it subclasses it), else its own name."""
    for base in cls.__mro__[1:]:
        if getattr(base, "name", "") not in ("", cls.name):
            return base.name
    return cls.name


def slots_for_fraction(trace: Trace, fraction: float) -> int:
    """Total slots holding ``fraction`` of all L x E experts (rounded)."""
    return fraction_slots(fraction, trace.num_layers * trace.num_experts)


def check_size(trace: Trace, spec: ReplayPolicy, slots: int, partition: str) -> int:
    """Validate one size for a resolved spec (slots, partition, top-k, the policy's own
    range checks) without building a table; returns the per-partition capacity."""
    cap = partition_shares(trace.num_layers, trace.num_experts, slots, partition,
                           trace.top_k)[0][1]
    spec.policy(cap)
    return cap


def check_table(trace: Trace, spec: ReplayPolicy, slots: int, partition: str,
                pinned: Sequence[int] = ()) -> SlotTable:
    """A fresh table for ``spec`` at one size (it validates everything it is given)."""
    return SlotTable(trace.num_layers, trace.num_experts, slots, eviction=spec.spec.eviction,
                     admission=spec.spec.admission, partition=partition, top_k=trace.top_k,
                     pinned=pinned)


class Prepared:
    """A trace turned into the arrays and lists replays need, each built once.

    ``order`` is the step order (``trace.steps``): None follows the trace's meta, so a
    recorded trace (``prefill_steps: batched``) replays its prompt as one step per
    layer, as the live run did; ``"token"`` or ``"batched"`` force one.
    """

    def __init__(self, trace: Trace, order: str | None = None) -> None:
        from ..trace.steps import batched_prompt, step_order
        self.trace = trace
        self.L, self.E = trace.num_layers, trace.num_experts
        self.order = step_order(trace, order)
        self.prompt = batched_prompt(trace, self.order)  # tokens merged into row 0; 0 = none

    @cached_property
    def _rows(self) -> tuple[list[list[list[int]]], list[int]]:
        from ..trace.steps import step_rows
        return step_rows(self.trace, self.order)

    @cached_property
    def keys(self) -> np.ndarray:        # int32 [R*L, W], -1 = padding or a repeat within a step
        from ..trace.steps import row_keys, step_rows
        if self.order == "grouped":      # steps of any width (an engine's batches)
            return row_keys(self._rows[0], self.E, self.trace.top_k)
        P = self.prompt
        tokens = step_keys(self.trace.experts[:, P:], self.E)  # [(T-P)*L, K]
        if not P:
            return tokens
        # The batched prompt's steps are wider than K: pad every row to the widest.
        prompt_rows = step_rows(self.trace.slice_tokens(P), "batched")[0]  # its one row
        head = row_keys(prompt_rows, self.E, tokens.shape[1])
        keys = np.full((head.shape[0] + tokens.shape[0], head.shape[1]), -1, np.int32)
        keys[:head.shape[0]] = head
        keys[head.shape[0]:, :tokens.shape[1]] = tokens
        return keys

    @cached_property
    def row_phases(self) -> list[int]:
        """Each row's phase (a row = one step per layer)."""
        return self._rows[1]

    @cached_property
    def phases(self) -> np.ndarray:      # uint8 [R*L]
        if self.order == "grouped":
            return np.repeat(np.asarray(self.row_phases, np.uint8), self.L)
        rows = self.trace.phases[self.prompt:].astype(np.uint8)
        if self.prompt:
            rows = np.concatenate([np.array([PREFILL], np.uint8), rows])
        return np.repeat(rows, self.L)

    @cached_property
    def future_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(starts, uses, nexts)``: every key's use steps in order, and each access's
        next use (``Future.from_arrays``)."""
        from ..policies.kernels.belady import future_from_keys
        return future_from_keys(self.keys, self.L * self.E)

    @cached_property
    def step_lists(self) -> list[list[list[int]]]:
        """Per row (a token, or the batched prompt), per layer: expert ids in rank order,
        repeats dropped."""
        return self._rows[0]

    @cached_property
    def widest_step(self) -> int:
        """Most keys one step needs: top-k, or more for a batched prompt."""
        if self.order == "grouped":
            return int((self.keys >= 0).sum(axis=1).max()) if self.keys.size else self.trace.top_k
        return int((self.keys[:self.L] >= 0).sum(axis=1).max()) if self.prompt \
            else self.trace.top_k

    def future(self) -> Future:
        E = self.E
        return Future([layer * E + e for e in ex]
                      for tok in self.step_lists for layer, ex in enumerate(tok))


def step_keys(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Token-major step keys: ``int32 [T*L, K]``, repeats within a step as -1.

    ``experts`` is ``int16 [L, T, K]``; step ``s = t*L + l`` needs ``keys[s]``.
    SlotTable.step keeps the first of repeated experts (dict.fromkeys), and so does this.
    """
    L, T, K = experts.shape
    keys = experts.transpose(1, 0, 2).astype(np.int32)            # T, L, K
    keys += (np.arange(L, dtype=np.int32) * num_experts)[None, :, None]
    keys = keys.reshape(T * L, K)
    srt = np.sort(keys, axis=1)
    rows = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))  # repeats are rare
    if rows.size:
        sub = keys[rows]
        orig = sub.copy()
        for j in range(1, K):
            sub[(orig[:, :j] == orig[:, j:j + 1]).any(axis=1), j] = -1
        keys[rows] = sub
    return keys


def replay(trace: Trace | Prepared, policy: str | PolicyPair | ReplayPolicy, slots: int,
           partition: str = "global", *, pinned: Iterable[int] = (), seed: Sequence[int] = (),
           engine: str = "auto", eviction_params: dict | None = None,
           admission_params: dict | None = None) -> ReplayResult:
    """Replay ``trace`` under ``policy`` (``EVICTION[+ADMISSION]``) with ``slots`` in total.

    ``pinned`` keys stay resident (imatrix hot sets); ``seed`` keys are preloaded
    and evictable. ``engine='fast'`` insists on a numba kernel, ``'table'`` on
    the SlotTable path; ``'auto'`` takes the kernel when it applies.
    """
    prep = trace if isinstance(trace, Prepared) else Prepared(trace)
    spec = resolve_policy(policy, eviction_params, admission_params)
    pinned, seed = list(pinned), list(seed)
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    kernel = None if pinned or seed else kernel_for(prep, spec)
    if engine == "fast" and kernel is None:
        from ..policies.kernels import have_numba
        if not have_numba():
            raise ValueError("engine 'fast' needs numba, which is not installed: "
                             "pip install 'expertcache[sim]' (or use engine 'table' or 'auto')")
        raise ValueError(f"no fast kernel for {spec.label!r} with these options; kernels cover "
                         "lru, fifo, belady, slru, arc, lfu, s3fifo and next-use with admission "
                         "always, second-hit, window or oracle, without pinned or seeded keys (use "
                         "engine 'table' or 'auto')")
    if kernel is not None and engine != "table":
        return kernel_result(prep, spec, kernel, slots, partition)
    stats = table_replay(prep, check_table(prep.trace, spec, slots, partition, pinned), seed)
    return ReplayResult(spec.eviction, spec.admission, partition, slots, stats, "table", spec.label,
                        spec)


def kernel_for(prep: Prepared, spec: ReplayPolicy):
    """The kernel module of ``spec``'s built-in policy, if it fits this trace; else None (a
    plug-in policy or admission rule, or no numba: the table replays it)."""
    from ..policies.kernels import compiled, have_numba, kernel_module
    if not have_numba() or not compiled(spec.admission_cls):
        return None
    module = kernel_module(spec.eviction_cls)
    if module is None or not getattr(module, "fits", _fits)(prep):
        return None
    return module


def _fits(prep: Prepared) -> bool:
    # Step numbers are int32 in the kernels: far more than any trace holds.
    return prep.keys.shape[0] < (1 << 31)


def kernel_result(prep: Prepared, spec: ReplayPolicy, kernel, slots: int,
                  partition: str) -> ReplayResult:
    """One size through ``kernel`` (from ``kernel_for``); validates the size first."""
    cap = check_size(prep.trace, spec, slots, partition)
    parts = 1 if partition == "global" else prep.L
    counts = run_kernel(prep, kernel, spec, parts, cap)
    return ReplayResult(spec.eviction, spec.admission, partition, slots, Stats(counts.tolist()),
                        f"{spec.eviction}-kernel", spec.label, spec)


def run_kernel(prep: Prepared, kernel, spec: ReplayPolicy, parts: int, cap: int,
               log: np.ndarray | None = None) -> np.ndarray:
    """Counts ``[2, L, 6]``: the whole trace through ``kernel``'s compiled replay, over the
    state ``SlotTable`` keeps for the same policy (``policies/kernels/table.py``). ``log``
    (int32 like ``prep.keys``): also write what each step loaded and evicted
    (``skeleton.replay_log``; ``sim/lag.py`` replays the lagged device from it)."""
    from ..policies.kernels import skeleton
    from ..policies.kernels.table import Admission
    policy = spec.policy(cap)
    nkeys, width = prep.L * prep.E, prep.keys.shape[1]
    admission = Admission(spec.admission_cls, spec.admission_params, nkeys, parts, width,
                          prep.trace.top_k)
    if policy.needs_future or spec.spec.admission.needs_future:
        # the kernel replays ``keys``' rows: their future, built compiled
        starts, uses, nexts = prep.future_arrays
        future = Future.from_arrays(starts, uses, prep.keys, nexts)
        if policy.needs_future:
            policy.bind_future(future)
        admission.bind_future(future, nkeys)
        policy.ties_by_future = spec.spec.admission.needs_future  # MIN with bypass (belady)
    st = kernel.state(policy, nkeys, parts, cap, width)
    sc = skeleton.scratch(prep.L, nkeys, parts, width)
    adm = admission.adm
    if log is None:
        kernel.replay(prep.keys, prep.phases, prep.L, parts, cap, st, sc, adm)
    else:
        kernel.replay_log(prep.keys, prep.phases, prep.L, parts, cap, st, sc, adm, log)
    return sc[0]


def lru_all_sizes(prep: Prepared, slots_list: Sequence[int], partition: str,
                  spec: ReplayPolicy | None = None) -> list[ReplayResult]:
    """LRU at every size from one pass of stack distances (``sim.stack``)."""
    from ..policies.kernels import lru
    from . import stack
    spec = spec or resolve_policy("lru")
    caps = [check_size(prep.trace, spec, slots, partition) for slots in slots_list]
    parts = 1 if partition == "global" else prep.L
    dist = None
    out = []
    for slots, cap in zip(slots_list, caps):
        if cap < prep.widest_step:
            # A step wider than the cache bypasses part of itself and the stack argument
            # (module doc of sim.stack) no longer holds: replay this size exactly.
            out.append(kernel_result(prep, spec, lru, slots, partition))
            continue
        if dist is None:
            dist = stack.lru_distances(prep.keys, prep.phases, prep.L, prep.E, parts)
        counts = stack.lru_counts_at(dist, cap, parts)
        out.append(ReplayResult("lru", "always", partition, slots, Stats(counts.tolist()),
                                "lru-stack", spec.label, spec))
    return out


def table_replay(prep: Prepared, table: SlotTable, seed: Sequence[int] = ()) -> Stats:
    """Step a fresh table (pinned keys already in) through the whole trace; its stats."""
    if seed:
        table.seed(seed)
    if table.needs_future:
        table.bind_future(prep.future())
    phases = prep.row_phases
    # The lists were validated and de-duplicated once, so call the table's
    # inner step directly: the same code as step() without per-call checks.
    step = table._step
    for tok, phase in zip(prep.step_lists, phases):
        for layer, experts in enumerate(tok):
            step(layer, experts, phase)
    return table.stats()
