"""One registry of eviction and admission policies for config, CLI and simulator.

Built-ins register with ``@register``; third-party packages expose classes (or
modules that register on import) through the entry-point group
``expertcache.policies``, loaded once on first lookup.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import NamedTuple

from .base import AdmissionPolicy, EvictionPolicy

ENTRY_POINT_GROUP = "expertcache.policies"

_EVICTION: dict[str, type[EvictionPolicy]] = {}
_ADMISSION: dict[str, type[AdmissionPolicy]] = {}
_BUILTIN_MODULES = ("lru", "fifo", "belady", "admission", "random_policy", "lfu", "slru", "lfru", "arc",
                    "s3fifo", "static", "next_use")
_loaded = False


def register(cls):
    """Class decorator: add an EvictionPolicy or AdmissionPolicy under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} needs a non-empty class attribute 'name'")
    if issubclass(cls, EvictionPolicy):
        table = _EVICTION
    elif issubclass(cls, AdmissionPolicy):
        table = _ADMISSION
    else:
        raise TypeError(f"{cls.__qualname__} is neither an EvictionPolicy nor an AdmissionPolicy")
    other = table.get(cls.name)
    if other is not None and other is not cls:
        raise ValueError(f"policy name {cls.name!r} is already taken by {other.__qualname__}")
    table[cls.name] = cls
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN_MODULES:
        importlib.import_module(f"{__package__}.{mod}")
    from importlib.metadata import entry_points  # ~30 ms: only when a policy is looked up
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        if isinstance(obj, type):
            register(obj)


def eviction_policies() -> dict[str, type[EvictionPolicy]]:
    _load()
    return dict(sorted(_EVICTION.items()))


def admission_policies() -> dict[str, type[AdmissionPolicy]]:
    _load()
    return dict(sorted(_ADMISSION.items()))


def _lookup(table: dict, kind: str, name: str):
    _load()
    cls = table.get(name)
    if cls is None:
        known = ", ".join(sorted(table))
        raise ValueError(f"unknown {kind} policy {name!r}; known {kind} policies: {known}")
    return cls


def eviction_class(name: str) -> type[EvictionPolicy]:
    return _lookup(_EVICTION, "eviction", name)


def admission_class(name: str) -> type[AdmissionPolicy]:
    return _lookup(_ADMISSION, "admission", name)


def check_params(cls, params: dict[str, object]) -> dict[str, object]:
    """Defaults merged with ``params``; unknown names and wrong types are ValueErrors."""
    unknown = sorted(set(params) - set(cls.params))
    if unknown:
        allowed = ", ".join(sorted(cls.params)) or "none"
        raise ValueError(f"policy {cls.name!r} has no parameter(s) {', '.join(unknown)}; "
                         f"its parameters: {allowed}")
    merged = dict(cls.params)
    for key, value in params.items():
        merged[key] = _coerce(cls.name, key, cls.params[key], value)
    return merged


def _coerce(policy: str, key: str, default: object, value: object) -> object:
    """Match a user value to the default's type; numbers must not be negative."""
    where = f"parameter {key!r} of policy {policy!r}"
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        try:
            number = float(value) if isinstance(value, str) else value
        except ValueError:
            number = None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or number != int(number):
            raise ValueError(f"{where} must be a whole number, got {value!r}")
        if number < 0:
            raise ValueError(f"{where} must not be negative, got {value!r}")
        return int(number)
    if isinstance(default, float):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} must be a number, got {value!r}") from None
        if number < 0:
            raise ValueError(f"{where} must not be negative, got {value!r}")
        return number
    return value


def needs_future(name: str | PolicySpec, params: dict[str, object] | None = None) -> bool:
    """True if eviction policy ``name`` with ``params`` is an offline oracle (it needs the
    future accesses), e.g. ``belady``, or ``static`` with ``inner='belady'``."""
    return eviction_spec(name, params).needs_future


def make_eviction(name: str | PolicySpec, capacity: int, **params: object) -> EvictionPolicy:
    """A fresh eviction policy; a ``PolicySpec`` is used as resolved (no second lookup)."""
    spec = name if isinstance(name, PolicySpec) and not params else eviction_spec(name, params)
    return spec.build(capacity)


def make_admission(name: str | PolicySpec, **params: object) -> AdmissionPolicy:
    spec = name if isinstance(name, PolicySpec) and not params else admission_spec(name, params)
    return spec.build()


# A policy's constructor is the one owner of its parameter ranges; a spec asks it by building
# one throwaway instance this big (big enough for any "at least N slots" rule, cheap to build).
_PROBE_CAPACITY = 1024


@dataclass(frozen=True, eq=False)
class PolicySpec:
    """One policy resolved once: its kind, registered name and class, and its parameters merged
    with the defaults, type-checked and range-checked (the policy's own constructor is asked at
    creation, so a spec that exists is one the runtime can build). Build one with
    ``eviction_spec`` / ``admission_spec``; ``str(spec)`` is the ``--policy`` syntax."""

    kind: str                  # "eviction" or "admission"
    name: str
    params: dict = field(default_factory=dict)
    cls: type = field(default=None, repr=False)

    def __post_init__(self) -> None:
        cls = _lookup(_TABLES[self.kind], self.kind, self.name) if self.cls is None else self.cls
        object.__setattr__(self, "cls", cls)
        object.__setattr__(self, "params", check_params(cls, dict(self.params)))
        self.build(_PROBE_CAPACITY)  # the policy's own range checks, before anything loads

    def build(self, capacity: int | None = None):
        """A fresh policy instance (eviction policies need the partition's ``capacity``)."""
        if self.kind == "eviction":
            return self.cls(capacity, **self.params)
        return self.cls(**self.params)

    @property
    def needs_future(self) -> bool:
        if self.kind == "admission":
            return self.cls.needs_future
        return self.cls.wants_future(self.params)

    def changed(self) -> dict[str, object]:
        """The parameters that differ from the policy's defaults."""
        return {k: v for k, v in self.params.items() if self.cls.params.get(k) != v}

    def to_dict(self) -> dict:
        return {"name": self.name, "params": dict(self.params)}

    def __str__(self) -> str:
        return ":".join([self.name, *(f"{k}={v}" for k, v in self.changed().items())])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PolicySpec):
            return NotImplemented
        return (self.kind, self.name, self.params) == (other.kind, other.name, other.params)

    def __hash__(self) -> int:
        return hash((self.kind, self.name, repr(sorted(self.params.items()))))


_TABLES = {"eviction": _EVICTION, "admission": _ADMISSION}


def _spec(kind: str, value: str | PolicySpec, params: dict | None) -> PolicySpec:
    if isinstance(value, PolicySpec):
        if value.kind != kind:
            raise ValueError(f"{value.name!r} is an {value.kind} policy, not an {kind} policy")
        return PolicySpec(kind, value.name, {**value.params, **(params or {})}, value.cls) \
            if params else value
    if not isinstance(value, str):
        raise TypeError(f"an {kind} policy is a name such as 'lru' or 'slru:protected=0.5' "
                        f"(or a PolicySpec), got {type(value).__name__}")
    name, parsed = _named_params(value, value)
    if not name:
        raise ValueError(f"empty {kind} policy {value!r}; write NAME or NAME:KEY=VALUE, e.g. "
                         "'slru:protected=0.5'")
    return PolicySpec(kind, name, {**parsed, **(params or {})})


def eviction_spec(value: str | PolicySpec, params: dict | None = None) -> PolicySpec:
    """``'slru:protected=0.5'`` (or a name plus ``params``, which win) -> a checked PolicySpec."""
    return _spec("eviction", value, params)


def admission_spec(value: str | PolicySpec, params: dict | None = None) -> PolicySpec:
    return _spec("admission", value, params)


def parse_spec(spec: str) -> tuple[str, str]:
    """'slru+second-hit' -> ('slru', 'second-hit'); 'lru' -> ('lru', 'always'); 'default' ->
    ('default', 'freq'): with no admission named, the eviction policy's own (``own_admission``)."""
    eviction, _, admission = spec.strip().partition("+")
    if not eviction:
        raise ValueError(f"empty policy in {spec!r}; write EVICTION or EVICTION+ADMISSION, e.g. 'lru' or 'slru+second-hit'")
    return eviction, admission or own_admission(eviction_class(eviction)).split(":")[0]


class PolicyPair(NamedTuple):
    """What every ``--policy`` names: an eviction and an admission policy, both resolved."""

    eviction: PolicySpec
    admission: PolicySpec

    def __str__(self) -> str:
        return f"{self.eviction}+{self.admission}"


def parse_policy(spec: str) -> PolicyPair:
    """'slru:protected=0.5+window:n=3' -> both policies as checked ``PolicySpec``s.

    Each side is ``NAME[:KEY=VALUE[:KEY=VALUE...]]``; ':' (not ',') separates parameters because
    sim and bench already take comma-separated lists of policies. Parameters are checked by
    ``PolicySpec`` (unknown names, types, ranges), so the CLI reports what the Python API reports.
    """
    sides = spec.strip().split("+")
    if len(sides) > 2:
        raise ValueError(f"policy {spec!r} has more than one '+'; write EVICTION[:k=v]+ADMISSION[:k=v]")
    if not sides[0].strip().split(":")[0].strip():
        raise ValueError(f"empty policy in {spec!r}; write EVICTION or EVICTION+ADMISSION, "
                         "e.g. 'lru' or 'slru:protected=0.5+second-hit'")
    eviction = PolicySpec("eviction", *_named_params(sides[0], spec))
    if len(sides) == 2:  # an admission named, even 'always', is the one that runs
        admission = PolicySpec("admission", *_named_params(sides[1], spec))
    else:
        admission = admission_spec(own_admission(eviction.cls))
    return PolicyPair(eviction, admission)


def own_admission(eviction_cls) -> str:
    """The admission an eviction policy runs with when none is named: the class's own
    ``admission`` (``default``: ``freq:reset=16384``), else ``'always'``. One rule for
    ``--policy``, ``CacheConfig`` and ``SlotTable``: a named admission always wins."""
    return getattr(eviction_cls, "admission", None) or "always"


def _named_params(side: str, spec: str) -> tuple[str, dict[str, str]]:
    name, *pairs = side.strip().split(":")
    params = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"bad policy parameter {pair!r} in {spec!r}; write NAME:KEY=VALUE, "
                             "e.g. 'slru:protected=0.5'")
        params[key.strip()] = value.strip()
    return name.strip(), params
