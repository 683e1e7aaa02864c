"""The two plug-in interfaces every cache policy implements (torch-free).

A policy answers one question; the container (``SlotTable``) owns the loop that
evicts and inserts. Keys are plain ints (``layer * num_experts + expert``) and
``now`` is an int clock the table injects, so policies stay deterministic.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import ClassVar


class EvictionPolicy:
    """Chooses which resident key leaves when a new one needs its slot.

    The table calls ``on_insert`` when a key becomes resident, ``on_access`` on
    every hit, and ``on_remove`` when a key leaves. ``victim`` is a pure query:
    it must not change what the policy would answer next, so the table may ask
    and then decide not to evict (admission said no).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # Parameter name -> default; the registry validates user values against it.
    params: ClassVar[dict[str, object]] = {}
    # True for oracles that must be given the future (see ``bind_future``).
    needs_future: ClassVar[bool] = False
    # A built-in's compiled logic (a module of expertcache.policies.kernels),
    # or None (a plug-in). A subclass that overrides a hook is refused (kernels.compiled).
    kernel: ClassVar[str | None] = None

    def __init__(self, capacity: int, **params: object) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"policy {self.name or type(self).__name__!r} needs a capacity of at "
                             f"least 1 slot, got {capacity!r}")
        self.capacity = capacity

    @classmethod
    def wants_future(cls, params: dict[str, object]) -> bool:
        """Whether an instance with these parameters will need ``bind_future``; for checks
        made before any instance exists (``registry.needs_future``)."""
        return cls.needs_future

    def on_insert(self, key: int, now: int) -> None:
        raise NotImplementedError

    def on_access(self, key: int, now: int) -> None:
        raise NotImplementedError

    def on_remove(self, key: int) -> None:
        raise NotImplementedError

    def victim(self, protected: Container[int]) -> int | None:
        """The key to evict, never one in ``protected``; None if all are protected."""
        raise NotImplementedError

    def pinned_keys(self) -> Iterable[int]:
        """Keys the table must keep resident forever (the ``static`` policy's set)."""
        return ()

    def bind_future(self, future: object) -> None:
        """Give an oracle the future accesses; online policies ignore it."""


class AdmissionPolicy:
    """Decides whether a missed key is cached at all or served as a bypass."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    params: ClassVar[dict[str, object]] = {}
    # False lets the table skip ``record`` calls on its hot path.
    records: ClassVar[bool] = True
    # True for an oracle rule that reads the future (``oracle``): replays only.
    needs_future: ClassVar[bool] = False
    # True for a built-in rule that weighs the key against the victim (``oracle``, ``freq``):
    # the compiled step asks it, so it runs with built-in eviction policies only.
    compares_victim: ClassVar[bool] = False
    # A built-in rule's code in the compiled step (policies/kernels/skeleton.py); None for a
    # plug-in, whose record / admit run as Python methods.
    kernel: ClassVar[int | None] = None

    def __init__(self, **params: object) -> None:
        pass

    def record(self, key: int, now: int) -> None:
        """Called for every access (hit or miss), before ``admit``."""

    def admit(self, candidate: int, victim: int | None) -> bool:
        """True to cache ``candidate`` (evicting ``victim`` unless it is None)."""
        raise NotImplementedError
