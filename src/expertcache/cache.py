"""SlotTable: which expert lives in which slot, and the plan for each step.

A *step* is one MoE layer's forward for one batch of tokens: the experts it
needs, in the router's rank order (decode) or the union over the batch
(prefill). The table answers with a ``Plan``: hits (key -> slot), loads (key ->
slot it is copied into, after the victims in ``evictions`` leave) and bypasses
(keys served without caching). The simulator counts plans; the runtime executes
them. Torch-free by design.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

from .keys import ExpertKey
from .policies.admission import Always, Never
from .policies.base import AdmissionPolicy, EvictionPolicy
from .policies.kernels import compiled
from .policies.registry import PolicySpec, make_admission, make_eviction, own_admission
from .stats import DECODE, FIELDS, Stats, phase_code

PARTITIONS = ("global", "per-layer")
# What the compiled step did with a key (policies/kernels/skeleton.py), and admission's
# answers: kept here as plain ints so that importing the table imports no numba.
IS_HIT, IS_LOAD, IS_BYPASS = 0, 1, 2
NO, FREE_ONLY, YES = 0, 1, 2


class Plan:
    """What one step needs done. Keys are ints ``layer * num_experts + expert``."""

    __slots__ = ("hits", "loads", "evictions", "bypasses")

    def __init__(self) -> None:
        self.hits: dict[int, int] = {}       # resident key -> its slot
        self.loads: dict[int, int] = {}      # key -> slot to copy it into
        self.evictions: dict[int, int] = {}  # evicted key -> the slot it gave up
        self.bypasses: list[int] = []        # keys to serve without caching

    def __repr__(self) -> str:
        return (f"Plan(hits={self.hits}, loads={self.loads}, "
                f"evictions={self.evictions}, bypasses={self.bypasses})")


class _Partition:
    """A share of the slots: its free slots and, for a plug-in eviction policy, the policy
    instance and the admission calls it runs with."""

    __slots__ = ("start", "capacity", "free", "policy", "record", "admit")

    def __init__(self, start: int, capacity: int, policy=None, admission=None, admit=None) -> None:
        self.start, self.capacity = start, capacity
        self.free = list(range(start + capacity - 1, start - 1, -1))  # pop() gives lowest first
        self.policy = policy
        # A plug-in admission policy's calls; None where they can be skipped (records
        # nothing / admits all) or where admission is a built-in rule (compiled).
        self.record = admission.record if admission is not None and admission.records else None
        self.admit = admit if admission is None else admission.admit


class _NoChoice(EvictionPolicy):
    """Stands in for a built-in policy in a table that can never evict (``_never_chooses``):
    it keeps no state and is never asked for a victim."""

    name = "none"

    def on_insert(self, key: int, now: int) -> None:
        pass

    def on_access(self, key: int, now: int) -> None:
        pass

    def on_remove(self, key: int) -> None:
        pass

    def victim(self, protected) -> None:
        return None


def _refuse(key: int, victim: int | None) -> bool:
    return False  # admission 'never'


def _never_chooses(admission: AdmissionPolicy, shares: list[tuple[int, int]], keys: int) -> bool:
    """Whether no step can need an eviction policy's choice: admission 'never' (nothing is
    cached), or 'always' with a slot for every key a partition can be given."""
    return type(admission) is Never or (type(admission) is Always and
                                         shares[0][1] * len(shares) >= keys)


class SlotTable:
    """Maps expert keys to slot ids ``0..slots-1`` under eviction and admission policies.

    ``eviction`` and ``admission`` are names (``"slru:protected=0.5"``), ``PolicySpec``s
    or policy instances (an instance of a plug-in class serves a global pool only: each
    partition needs its own); admission None (the default) is the eviction policy's own
    (``registry.own_admission``: ``freq`` for ``default``, else ``always``), and any admission
    named runs as named. Built-in policies run compiled (``policies/kernels``, the
    code the simulator replays with); plug-ins run as Python methods.
    ``partition='global'`` shares all slots among layers; ``'per-layer'`` gives each
    layer ``slots // num_layers``. ``pinned`` keys (plus the eviction policy's own
    ``pinned_keys()``) are loaded at construction, count against capacity and are
    never evicted.
    """

    def __init__(self, num_layers: int, num_experts: int, slots: int, *,
                 eviction: str | PolicySpec | EvictionPolicy = "lru",
                 admission: str | PolicySpec | AdmissionPolicy | None = None,
                 partition: str = "global", top_k: int | None = None,
                 pinned: Iterable[int | tuple[int, int]] = (),
                 eviction_params: dict | None = None,
                 admission_params: dict | None = None) -> None:
        _check_positive("num_layers", num_layers)
        _check_positive("num_experts", num_experts)
        self.num_layers, self.num_experts, self.slots = num_layers, num_experts, slots
        self.partition, self.top_k = partition, top_k
        shares = partition_shares(num_layers, num_experts, slots, partition, top_k)
        policies = [_eviction(eviction, eviction_params, cap, len(shares)) for _, cap in shares]
        if admission is None:  # none named: the eviction policy's own (default: freq), else always
            admission = own_admission(type(policies[0]))
        adm_policy = _admission(admission, admission_params)
        self.eviction_name, self.admission_name = policies[0].name, adm_policy.name
        policy_pins = set()
        for i, policy in enumerate(policies):  # a wrapper (static): its pins, then its inner
            while isinstance(getattr(policy, "inner", None), EvictionPolicy):
                policy_pins.update(policy.pinned_keys())
                policy = policy.inner
            policy_pins.update(policy.pinned_keys())
            policies[i] = policy
        self.needs_future = policies[0].needs_future or adm_policy.needs_future
        self._kernel = self._admission = None
        if compiled(type(policies[0])) and _never_chooses(adm_policy, shares, num_layers * num_experts):
            # No step can ask the policy anything (every key fits, or nothing is cached): plain
            # lookups, without loading the compiled kernels (numba and LLVM: about 100 MB and
            # their load time, for a resident or copy-every-pass run)
            admit = _refuse if type(adm_policy) is Never else None
            self._parts = [_Partition(start, cap, _NoChoice(cap), admit=admit) for start, cap in shares]
        elif compiled(type(policies[0])):  # built-in: the compiled step
            if not compiled(type(adm_policy)):
                raise ValueError(f"admission policy {adm_policy.name!r} is a plug-in: it runs with "
                                 f"plug-in eviction policies only, and {policies[0].name!r} is a "
                                 "built-in (compiled); use a built-in admission rule")
            from .policies.kernels.table import Kernel
            self._kernel = Kernel(policies[0], type(adm_policy), _params(adm_policy),
                                  num_layers, num_experts, len(shares), shares[0][1], top_k)
            self._parts = [_Partition(start, cap) for start, cap in shares]
        else:
            if adm_policy.compares_victim:
                raise ValueError(f"admission {adm_policy.name!r} weighs the key against the "
                                 f"victim: it runs with built-in eviction policies only, "
                                 f"and {policies[0].name!r} is a plug-in")
            if compiled(type(adm_policy)):
                from .policies.kernels.table import Admission
                self._admission = Admission(type(adm_policy), _params(adm_policy),
                                            num_layers * num_experts, len(shares))
            self._parts = [_Partition(start, cap, policy,
                                      None if self._admission else _admission(admission,
                                                                              admission_params))
                           for (start, cap), policy in zip(shares, policies)]
        self._part_of_layer = (self._parts * num_layers if partition == "global"
                               else self._parts)
        self._future_bound = False
        self._expert_ids = frozenset(range(num_experts))  # valid expert ids, for one-call checks
        self._slot_of: dict[int, int] = {}
        self._key_of: list[int | None] = [None] * slots
        self._pinned: set[int] = set()
        self._now = 0
        self._layer_now = [0] * num_layers
        self._counts = [[[0] * len(FIELDS) for _ in range(num_layers)] for _ in range(2)]
        self._pin(list(pinned) + sorted(policy_pins))

    # -- construction helpers -------------------------------------------------
    def _pin(self, keys: list) -> list[int]:
        """Pin ``keys`` into free slots, all or none; returns the newly pinned keys."""
        new = list(dict.fromkeys(k for k in map(self.as_key, keys) if k not in self._pinned))
        wanted: dict[int, int] = {}  # id(partition) -> free slots it must give
        for key in new:
            part = self._part_of_layer[key // self.num_experts]
            wanted[id(part)] = n = wanted.get(id(part), 0) + 1
            if n > len(part.free):  # checked before any slot is taken: no half-pinned table
                raise ValueError(f"too many pinned experts: {ExpertKey(*divmod(key, self.num_experts))} "
                                 f"does not fit in a partition of {part.capacity} slots "
                                 f"({len(part.free)} free)")
        for key in new:
            part = self._part_of_layer[key // self.num_experts]
            slot = part.free.pop()
            self._slot_of[key], self._key_of[slot] = slot, key
            self._pinned.add(key)
            if self._kernel is not None:
                self._kernel.pin(key, self._part_index(key // self.num_experts))
        return new

    # -- queries --------------------------------------------------------------
    def key(self, layer: int, expert: int) -> int:
        layer, expert = _whole("layer", layer), _whole("expert", expert)
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise ValueError(f"expert key out of range: layer {layer}, expert {expert}; this table has "
                             f"{self.num_layers} layers x {self.num_experts} experts")
        return layer * self.num_experts + expert

    def as_key(self, item: int | tuple[int, int]) -> int:
        """The int key of ``item``: an int key (range-checked) or a ``(layer, expert)`` pair."""
        if isinstance(item, tuple):
            if len(item) != 2:
                raise ValueError(f"an expert key pair is (layer, expert), got {item!r}")
            return self.key(*item)
        return self._check_key(item)

    def _check_key(self, key: int) -> int:
        key = _whole("expert key", key)
        if not 0 <= key < self.num_layers * self.num_experts:
            raise ValueError(f"expert key {key} out of range 0..{self.num_layers * self.num_experts - 1}")
        return key

    def slot_of(self, key: int) -> int | None:
        return self._slot_of.get(key)

    def resident(self) -> dict[int, int]:
        """A copy of key -> slot for every resident key (pinned included)."""
        return dict(self._slot_of)

    @property
    def pinned(self) -> frozenset[int]:
        return frozenset(self._pinned)

    @property
    def partition_capacity(self) -> int:
        return self._parts[0].capacity

    @property
    def kernel(self):
        """The compiled state of a built-in policy (``policies.kernels.table.Kernel``: its
        module and arrays, read-only by contract), or None for a plug-in and for a table
        that never evicts (``_never_chooses``). For checks and research code that read a
        policy's state without patching the table."""
        return self._kernel

    def stats(self) -> Stats:
        if self._kernel is not None:
            return Stats(self._kernel.counts.tolist())
        return Stats(self._counts)

    def reset_stats(self) -> None:
        if self._kernel is not None:
            self._kernel.counts[:] = 0
        for phase in self._counts:
            for row in phase:
                row[:] = [0] * len(FIELDS)

    def _part_index(self, layer: int) -> int:
        return 0 if len(self._parts) == 1 else layer

    # -- mutation -------------------------------------------------------------
    def bind_future(self, future: object) -> None:
        """Hand the future accesses to an oracle policy (``belady``): a ``Future`` of the
        steps this table will be given, in order."""
        if self._kernel is not None:
            self._kernel.bind_future(future)
        else:
            for part in self._parts:
                part.policy.bind_future(future)
        self._future_bound = True

    def pin(self, keys: Iterable[int | tuple[int, int]]) -> Plan:
        """Keep ``keys`` (int keys or ``(layer, expert)`` pairs) resident for good.

        Same as the constructor's ``pinned=``: pinned keys take free slots, count
        against their partition's capacity and are never evicted; the policy never
        sees them. Only a fresh table accepts pins (no step run, nothing seeded),
        because a pin must not take a slot a live key holds. Returns a Plan whose
        ``loads`` map each newly pinned key to its slot (the copies to make).
        Nothing is pinned if the keys do not all fit (ValueError).
        """
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            raise TypeError(f"pin() takes an iterable of keys (ints or (layer, expert) pairs), "
                            f"got {keys!r}; wrap a single key in a list")
        if self._now or len(self._slot_of) > len(self._pinned):
            raise ValueError("pin() needs a fresh table: pin before the first step and before "
                             "seed() (or pass pinned= to SlotTable); seed() preloads keys that "
                             "may be evicted later")
        plan = Plan()
        for key in self._pin(list(keys)):
            plan.loads[key] = self._slot_of[key]
        return plan

    def seed(self, keys: Iterable[int | tuple[int, int]]) -> Plan:
        """Preload keys into free slots (evictable later); no access is counted."""
        self._check_future()
        plan = Plan()
        keys = [self.as_key(item) for item in keys]
        if self._kernel is not None:
            loaded = self._kernel.seed(keys, self._now)
        for i, key in enumerate(keys):
            part = self._part_of_layer[key // self.num_experts]
            if self._kernel is not None:
                if not loaded[i]:
                    continue
            elif key in self._slot_of or not part.free:
                continue
            else:
                part.policy.on_insert(key, self._now)
            slot = part.free.pop()
            self._slot_of[key], self._key_of[slot] = slot, key
            plan.loads[key] = slot
        return plan

    def _check_future(self) -> None:
        if self.needs_future and not self._future_bound:
            oracle_admits = self.admission_name == "oracle" and self.eviction_name != "belady"
            name = self.admission_name if oracle_admits else self.eviction_name
            raise ValueError(f"policy {name!r} is an offline oracle: it needs the future "
                             "accesses, which only a replayed trace has (expertcache sim / bench)")

    def step(self, layer: int, experts: Sequence[int], phase: int | str = DECODE) -> Plan:
        """Plan one layer's forward needing ``experts`` (router rank order, rank 0 first)."""
        self._check_future()
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        if phase != DECODE:
            phase = phase_code(phase)
        tolist = getattr(experts, "tolist", None)
        if tolist is not None:  # numpy / torch: plain ints, or int16 keys would overflow
            experts = tolist()
        unique = dict.fromkeys(experts)  # dedupe, keep rank order (one C call, no list)
        if not self._expert_ids.issuperset(unique):
            bad = [e for e in unique if e not in self._expert_ids]
            raise ValueError(f"expert id(s) {bad} out of range 0..{self.num_experts - 1} at layer {layer}")
        return self._step(layer, unique, phase)

    def _step(self, layer: int, experts: dict[int, None], phase: int) -> Plan:
        """``experts``: unique ids in rank order (checked). The compiled step for a built-in
        policy, the Python one for a plug-in."""
        if self._kernel is None:
            return self._plugin_step(layer, experts, phase)
        plan = Plan()
        base = layer * self.num_experts
        keys = [base + e for e in experts]
        kinds, victims = self._kernel.step(keys, self._now, layer, self._layer_now[layer], phase,
                                           self._part_index(layer))
        slot_of, key_of, free = self._slot_of, self._key_of, self._part_of_layer[layer].free
        for key, kind, victim in zip(keys, kinds, victims):
            if kind == IS_HIT:
                plan.hits[key] = slot_of[key]
            elif kind == IS_LOAD:
                if victim >= 0:
                    slot = plan.evictions[victim] = slot_of.pop(victim)
                else:
                    slot = free.pop()
                slot_of[key] = slot
                key_of[slot] = key
                plan.loads[key] = slot
            else:
                plan.bypasses.append(key)
        self._now += 1
        self._layer_now[layer] += 1
        return plan

    def _plugin_step(self, layer: int, experts: dict[int, None], phase: int) -> Plan:
        # A plug-in eviction policy's methods, called as the compiled step calls its hooks
        # (policies/kernels/skeleton.py): keys in rank order, admission's record before
        # its answer, a victim only when the partition is full. Admission is a built-in
        # rule (its answers for the whole step come from the compiled rule first) or a
        # plug-in (record / admit called per key).
        plan = Plan()
        hits, loads, evictions, bypasses = plan.hits, plan.loads, plan.evictions, plan.bypasses
        part = self._part_of_layer[layer]
        policy, free, record, admit = part.policy, part.free, part.record, part.admit
        slot_of, key_of, pinned, now = self._slot_of, self._key_of, self._pinned, self._now
        layer_now = self._layer_now[layer]
        base = layer * self.num_experts
        keys = [base + e for e in experts]
        answers = (self._admission.answers(keys, self._part_index(layer), layer_now)
                   if self._admission is not None else None)
        protected = None
        for i, key in enumerate(keys):
            if record is not None:
                record(key, layer_now)
            slot = slot_of.get(key)
            if slot is not None:
                hits[key] = slot
                if key not in pinned:
                    policy.on_access(key, now)
                continue
            if free:
                if (answers[i] == NO) if answers is not None else \
                        (admit is not None and not admit(key, None)):
                    bypasses.append(key)
                    continue
                slot = free.pop()
            else:
                if protected is None:
                    protected = set(keys)
                victim = policy.victim(protected)
                if victim is None or ((answers[i] != YES) if answers is not None else
                                      (admit is not None and not admit(key, victim))):
                    bypasses.append(key)
                    continue
                slot = slot_of.pop(victim)
                policy.on_remove(victim)
                evictions[victim] = slot
            slot_of[key] = slot
            key_of[slot] = key
            policy.on_insert(key, now)
            loads[key] = slot
        row = self._counts[phase][layer]
        n, h = len(keys), len(hits)
        row[0] += n
        row[1] += h
        row[2] += n - h
        row[3] += len(loads)
        row[4] += len(evictions)
        row[5] += len(bypasses)
        self._now = now + 1
        self._layer_now[layer] = layer_now + 1
        return plan


def partition_shares(num_layers: int, num_experts: int, slots: int, partition: str,
                     top_k: int | None = None) -> list[tuple[int, int]]:
    """``(first slot, capacity)`` of each partition; ValueError if ``slots`` cannot hold
    one step of ``top_k`` keys per partition. The one place a table size is checked
    (SlotTable and the simulator's kernels both ask it)."""
    _check_positive("slots", slots)
    if partition not in PARTITIONS:
        raise ValueError(f"unknown partition {partition!r}; use one of {', '.join(PARTITIONS)}")
    if top_k is not None:
        _check_positive("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    if partition == "global":
        shares = [(0, slots)]
    else:
        per = slots // num_layers
        if per < 1:
            raise ValueError(f"per-layer partition of {slots} slots over {num_layers} "
                             f"layers leaves no slot per layer; give at least {num_layers} slots")
        shares = [(i * per, per) for i in range(num_layers)]
    cap = shares[0][1]
    if top_k is not None and cap < top_k:
        where = "the pool" if partition == "global" else "each layer's partition"
        raise ValueError(f"capacity below top-k: {where} holds {cap} slots but one step needs "
                         f"up to top_k={top_k}; give at least "
                         f"{top_k * (1 if partition == 'global' else num_layers)} slots")
    return shares


def _whole(name: str, value: object) -> int:
    """A plain int from an int-like value (numpy integers too); anything else is a ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a whole number (layer * num_experts + expert, or a "
                         f"(layer, expert) pair), got {value!r}") from None


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, got {value!r}")


def _eviction(value, params: dict | None, capacity: int, partitions: int) -> EvictionPolicy:
    """One partition's eviction policy from a name, a spec or an instance."""
    if isinstance(value, EvictionPolicy):
        if params:
            raise ValueError("eviction_params go with a policy name or spec, not an instance")
        if not compiled(type(value)) and partitions > 1:
            raise ValueError(f"a plug-in policy instance ({value.name!r}) holds one partition's "
                             "state: pass its name or PolicySpec for a per-layer table")
        return value
    return make_eviction(value, capacity, **(params or {}))


def _admission(value, params: dict | None) -> AdmissionPolicy:
    if isinstance(value, AdmissionPolicy):
        if params:
            raise ValueError("admission_params go with a policy name or spec, not an instance")
        return value
    return make_admission(value, **(params or {}))


def _params(policy) -> dict:
    """A policy instance's parameters, read back under their registered names."""
    return {name: getattr(policy, name) for name in type(policy).params}
