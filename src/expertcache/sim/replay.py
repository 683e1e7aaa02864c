"""Replay a routing trace through ``SlotTable``: the simulator's ground truth.

Semantics (issue 3): cold start; steps run token-major (token 0 layers
0..L-1, then token 1, ...); every access is counted; a hit is a key resident
when its step begins; the phase comes from the trace. A recorded trace (meta
``prefill_steps: batched``) replays its prompt as one step per layer, the
union of the prompt tokens' experts, as the live run planned it
(``trace.steps``); the kernels take such steps padded to the widest. ``belady`` is the exact
optimum with forced admission: the table is handed a ``Future`` built from the
same steps. The table is the runtime's own code, so simulated and live hit
rates cannot drift apart; ``sim.fast``, ``sim.fast_lists``, ``sim.fast_s3fifo`` and
``sim.fast_next_use`` kernels are exact copies of it for lru, fifo, belady, slru, arc,
lfu, s3fifo and next-use (alias default)
(tested equal) and are used when they apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..cache import PARTITIONS, SlotTable
from ..policies.belady import Future
from ..policies.registry import eviction_policies, parse_policy
from ..stats import Counts, Stats
from ..trace.format import Trace

FAST_POLICIES = ("lru", "fifo", "belady", "slru", "arc", "lfu", "s3fifo", "next-use", "default")
# Admission policies the lru / fifo kernels reproduce, by kernel code (sim.fast.ADMIT_*).
FAST_ADMISSIONS = {"always": 0, "second-hit": 1, "window": 2}
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
    label: str = ""    # what the user asked for, e.g. "default" -> "default (lru)"

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
class PolicySpec:
    """A parsed ``EVICTION[:k=v][+ADMISSION[:k=v]]`` with the label to show for it."""

    eviction: str
    admission: str
    label: str
    eviction_params: tuple = ()   # (name, value) pairs as given on the command line
    admission_params: tuple = ()

    def params(self, eviction_params: dict | None, admission_params: dict | None) -> tuple[dict, dict]:
        """Explicit parameters win over the spec's own."""
        return (dict(self.eviction_params) if eviction_params is None else eviction_params,
                dict(self.admission_params) if admission_params is None else admission_params)


def resolve_policy(spec: str) -> PolicySpec:
    """Parse a spec, check both names are registered and their parameters (ValueErrors with
    the Python API's messages).

    ``default`` means the registry's ``default`` policy when one is registered,
    else ``lru``; the label then says which ran.
    """
    label = spec.strip()
    fallback = label.split("+")[0].split(":")[0].strip() == "default" and "default" not in eviction_policies()
    p = parse_policy(label.replace("default", "lru", 1) if fallback else label)
    if fallback:
        label = label.replace("default", "default (lru)", 1)
    elif p.eviction == "default":
        from ..policies.registry import eviction_class
        label = label.replace("default", f"default ({_aliased(eviction_class('default'))})", 1)
    return PolicySpec(p.eviction, p.admission, label, tuple(p.eviction_params.items()),
                      tuple(p.admission_params.items()))


def _aliased(cls) -> str:
    """The registered policy an alias class stands for (it subclasses it), else its own name."""
    for base in cls.__mro__[1:]:
        if getattr(base, "name", "") not in ("", cls.name):
            return base.name
    return cls.name


def slots_for_fraction(trace: Trace, fraction: float) -> int:
    """Total slots holding ``fraction`` of all L x E experts (rounded)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction {fraction} is outside (0, 1]: give the share of all "
                         f"{trace.num_layers} x {trace.num_experts} experts the slots hold, e.g. 0.125")
    return max(1, round(fraction * trace.num_layers * trace.num_experts))


def per_partition(slots: int, partition: str, num_layers: int) -> int:
    return slots if partition == "global" else slots // num_layers


def check_table(trace: Trace, spec: PolicySpec, slots: int, partition: str,
                eviction_params: dict | None = None,
                admission_params: dict | None = None, pinned: Sequence[int] = ()) -> SlotTable:
    """Build the table once: it validates slots, partition, top-k and parameters."""
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; use one of {', '.join(PARTITIONS)}")
    eviction_params, admission_params = spec.params(eviction_params, admission_params)
    return SlotTable(trace.num_layers, trace.num_experts, slots, eviction=spec.eviction,
                     admission=spec.admission, partition=partition, top_k=trace.top_k,
                     pinned=pinned, eviction_params=eviction_params,
                     admission_params=admission_params)


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
        from ..trace.steps import row_keys
        from .fast import step_keys
        P = self.prompt
        tokens = step_keys(self.trace.experts[:, P:], self.E)  # [(T-P)*L, K]
        if not P:
            return tokens
        # The batched prompt's steps are wider than K: pad every row to the widest.
        head = row_keys(self.step_lists[:1], self.E, tokens.shape[1])
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
        return np.repeat(np.asarray(self.row_phases, dtype=np.uint8), self.L)

    @cached_property
    def nexts(self) -> np.ndarray:       # int64 [R*L, W] next step using each key
        from .fast import next_uses
        return next_uses(self.keys)

    @cached_property
    def step_lists(self) -> list[list[list[int]]]:
        """Per row (a token, or the batched prompt), per layer: expert ids in rank order,
        repeats dropped."""
        return self._rows[0]

    @cached_property
    def widest_step(self) -> int:
        """Most keys one step needs: top-k, or more for a batched prompt."""
        return max((len(ex) for ex in self.step_lists[0]), default=0) if self.prompt \
            else self.trace.top_k

    def future(self) -> Future:
        E = self.E
        return Future([layer * E + e for e in ex]
                      for tok in self.step_lists for layer, ex in enumerate(tok))


def replay(trace: Trace | Prepared, policy: str, slots: int, partition: str = "global", *,
           pinned: Iterable[int] = (), seed: Sequence[int] = (), engine: str = "auto",
           eviction_params: dict | None = None,
           admission_params: dict | None = None) -> ReplayResult:
    """Replay ``trace`` under ``policy`` (``EVICTION[+ADMISSION]``) with ``slots`` in total.

    ``pinned`` keys stay resident (imatrix hot sets); ``seed`` keys are preloaded
    and evictable. ``engine='fast'`` insists on a numba kernel, ``'table'`` on
    the SlotTable path; ``'auto'`` takes the kernel when it applies.
    """
    prep = trace if isinstance(trace, Prepared) else Prepared(trace)
    spec = resolve_policy(policy)
    pinned, seed = list(pinned), list(seed)
    table = check_table(prep.trace, spec, slots, partition, eviction_params, admission_params,
                        pinned)
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    fast_ok = has_kernel(spec) and not pinned and not seed and kernel_fits(prep)
    if engine == "fast" and not fast_ok:
        raise ValueError(f"no fast kernel for {spec.label!r} with these options; kernels cover "
                         "lru and fifo (admission always, second-hit or window), belady, slru, "
                         "arc, lfu, s3fifo and next-use, without pinned or seeded keys (use engine 'table' or 'auto')")
    if fast_ok and engine != "table":
        counts, name = fast_counts(prep, spec, slots, partition, eviction_params,
                                   admission_params)
        stats = Stats(counts.tolist())
    else:
        stats, name = table_replay(prep, table, seed), "table"
    return ReplayResult(spec.eviction, spec.admission, partition, slots, stats, name, spec.label)


def kernel_fits(prep: Prepared) -> bool:
    """Kernels pack keys into 21 bits (belady) and use counts below 2**27 (lfu):
    bigger tables or traces replay through SlotTable instead."""
    from .fast import KEY_BITS
    return prep.L * prep.E < (1 << KEY_BITS) and prep.trace.experts.size < (1 << 27)


def has_kernel(spec: PolicySpec) -> bool:
    """True if a numba kernel reproduces ``spec`` (with any parameter values)."""
    if spec.eviction in ("lru", "fifo"):
        return spec.admission in FAST_ADMISSIONS
    if spec.eviction in ("next-use", "default"):
        # the kernel mirrors NextUse itself: a plugin registered as 'default' is not it
        from ..policies.next_use import NextUse
        from ..policies.registry import eviction_class
        cls = eviction_class(spec.eviction)
        same = ("victim", "on_insert", "on_access", "on_remove", "_use")
        if not (issubclass(cls, NextUse) and all(getattr(cls, f) is getattr(NextUse, f) for f in same)):
            return False
    return spec.eviction in FAST_POLICIES and spec.admission == "always"


def fast_counts(prep: Prepared, spec: PolicySpec, slots: int, partition: str,
                eviction_params: dict | None = None,
                admission_params: dict | None = None) -> tuple[np.ndarray, str]:
    """Counts ``[2, L, 6]`` from the numba kernel for ``spec`` at one size."""
    from ..policies.registry import admission_class, check_params, eviction_class
    from . import fast, fast_lists
    parts = 1 if partition == "global" else prep.L
    cap = per_partition(slots, partition, prep.L)
    name = f"{spec.eviction}-kernel"
    eviction_params, admission_params = spec.params(eviction_params, admission_params)
    args = (prep.keys, prep.phases, prep.L, prep.E, parts, cap)
    ev = check_params(eviction_class(spec.eviction), eviction_params or {})
    if spec.eviction == "belady":
        return fast.belady_replay(prep.keys, prep.nexts, prep.phases, prep.L, prep.E,
                                  parts, cap), name
    if spec.eviction == "slru":
        return fast_lists.slru_replay(*args, int(ev["protected"] * cap)), name
    if spec.eviction == "arc":
        return fast_lists.arc_replay(*args), name
    if spec.eviction == "lfu":
        return fast_lists.lfu_replay(*args, int(ev["decay"]) or 8 * cap), name
    if spec.eviction in ("next-use", "default"):
        from ..policies.registry import make_eviction
        from .fast_next_use import next_use_replay
        return next_use_replay(*args, make_eviction(spec.eviction, cap, **ev)), name
    if spec.eviction == "s3fifo":
        from ..policies.registry import make_eviction
        from .fast_s3fifo import s3fifo_replay
        target = make_eviction("s3fifo", cap, **ev).small_target  # the policy's own rounding
        return s3fifo_replay(*args, target), name
    ad = check_params(admission_class(spec.admission), admission_params or {})
    counts = fast.list_replay(*args, spec.eviction == "lru", FAST_ADMISSIONS[spec.admission],
                              int(ad.get("ghost", 1)), int(ad.get("n", 1)), int(ad.get("w", 1)))
    return counts, name


def lru_all_sizes(prep: Prepared, slots_list: Sequence[int], partition: str) -> list[ReplayResult]:
    """LRU at every size from one pass of stack distances (see ``sim.fast``)."""
    from . import fast
    spec = resolve_policy("lru")
    for slots in slots_list:
        check_table(prep.trace, spec, slots, partition)
    parts = 1 if partition == "global" else prep.L
    dist = fast.lru_distances(prep.keys, prep.phases, prep.L, prep.E, parts)
    out = []
    for slots in slots_list:
        cap = per_partition(slots, partition, prep.L)
        if cap < prep.widest_step:
            # A step wider than the cache bypasses part of itself and the stack argument
            # (module doc of sim.fast) no longer holds: replay this size exactly instead.
            counts, engine = fast_counts(prep, spec, slots, partition)
        else:
            counts, engine = fast.lru_counts_at(dist, cap, parts), "lru-stack"
        out.append(ReplayResult("lru", "always", partition, slots, Stats(counts.tolist()),
                                engine, "lru"))
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
