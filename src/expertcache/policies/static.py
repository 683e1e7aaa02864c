"""Static placement: a fixed set of pinned keys plus a dynamic policy for the rest.

The pinned set (``keys``: ints ``layer * num_experts + expert``, as a list or a
string like ``"3, 17, 200"``, e.g. the hot experts of an imatrix) is returned by
``pinned_keys()``; the slot table loads those keys once, counts them against
capacity and never evicts them. Every other key is managed by the ``inner``
policy (default ``lru``), which the table never shows a pinned key. With an
empty ``keys`` the policy is just its inner policy.
"""

from __future__ import annotations

import re

from .base import EvictionPolicy
from .registry import eviction_class, make_eviction, register


def parse_keys(keys: object) -> tuple[int, ...]:
    """A list/tuple/set of ints, or a string of ints separated by commas or spaces."""
    if isinstance(keys, str):
        items = [item for item in re.split(r"[,\s]+", keys.strip()) if item]
    elif isinstance(keys, (list, tuple, set, frozenset)):
        items = list(keys)
    else:
        raise ValueError(f"parameter 'keys' of policy 'static' must be a list of ints or a string "
                         f"like '3,17,200', got {type(keys).__name__}")
    out = []
    for item in items:
        try:
            key = int(item) if isinstance(item, str) else item
        except ValueError:
            key = None
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"parameter 'keys' of policy 'static' holds {item!r}: each key must be "
                             f"a whole number >= 0 (layer * num_experts + expert)")
        out.append(key)
    return tuple(sorted(set(out)))


@register
class Static(EvictionPolicy):
    name = "static"
    description = "pinned set `keys` (never evicted) plus an `inner` dynamic policy for the other slots"
    params = {"keys": "", "inner": "lru"}

    def __init__(self, capacity: int, keys: object = "", inner: str = "lru", **params: object) -> None:
        super().__init__(capacity)
        self.keys = parse_keys(keys)
        if inner == self.name:
            raise ValueError("policy 'static' cannot use 'static' as its inner policy; pick e.g. 'lru'")
        # The inner policy sees the whole capacity: pinned keys of a per-layer table
        # are spread over partitions, so how many land in this one is not known here.
        self.inner = make_eviction(inner, capacity)
        self.needs_future = self.inner.needs_future

    @classmethod
    def wants_future(cls, params: dict[str, object]) -> bool:
        inner = params.get("inner", cls.params["inner"])
        return inner != cls.name and eviction_class(inner).wants_future({})

    def pinned_keys(self):
        return self.keys

    def bind_future(self, future: object) -> None:
        self.inner.bind_future(future)

    def on_insert(self, key: int, now: int) -> None:
        self.inner.on_insert(key, now)

    def on_access(self, key: int, now: int) -> None:
        self.inner.on_access(key, now)

    def on_remove(self, key: int) -> None:
        self.inner.on_remove(key)

    def victim(self, protected) -> int | None:
        return self.inner.victim(protected)
