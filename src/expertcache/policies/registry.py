"""One registry of eviction and admission policies for config, CLI and simulator.

Built-ins register with ``@register``; third-party packages expose classes (or
modules that register on import) through the entry-point group
``expertcache.policies``, loaded once on first lookup.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
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


def make_eviction(name: str, capacity: int, **params: object) -> EvictionPolicy:
    cls = eviction_class(name)
    return cls(capacity, **check_params(cls, params))


def make_admission(name: str, **params: object) -> AdmissionPolicy:
    cls = admission_class(name)
    return cls(**check_params(cls, params))


def parse_spec(spec: str) -> tuple[str, str]:
    """'slru+second-hit' -> ('slru', 'second-hit'); 'lru' -> ('lru', 'always')."""
    eviction, _, admission = spec.strip().partition("+")
    if not eviction:
        raise ValueError(f"empty policy in {spec!r}; write EVICTION or EVICTION+ADMISSION, e.g. 'lru' or 'slru+second-hit'")
    return eviction, admission or "always"


class PolicyParams(NamedTuple):
    eviction: str
    eviction_params: dict
    admission: str
    admission_params: dict


def parse_policy(spec: str) -> PolicyParams:
    """'slru:protected=0.5+window:size=64' -> names and validated parameters of both policies.

    Each side is ``NAME[:KEY=VALUE[:KEY=VALUE...]]``; ':' (not ',') separates parameters because
    sim and bench already take comma-separated lists of policies. Parameters are checked by
    ``check_params`` (unknown names, types), so the CLI reports what the Python API reports.
    """
    sides = spec.strip().split("+")
    if len(sides) > 2:
        raise ValueError(f"policy {spec!r} has more than one '+'; write EVICTION[:k=v]+ADMISSION[:k=v]")
    eviction, eviction_params = _named_params(sides[0], spec)
    admission, admission_params = _named_params(sides[1] if len(sides) == 2 else "always", spec)
    if not eviction:
        raise ValueError(f"empty policy in {spec!r}; write EVICTION or EVICTION+ADMISSION, "
                         "e.g. 'lru' or 'slru:protected=0.5+second-hit'")
    return PolicyParams(eviction, check_params(eviction_class(eviction), eviction_params),
                        admission, check_params(admission_class(admission), admission_params))


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
