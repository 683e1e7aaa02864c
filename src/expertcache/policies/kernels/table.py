"""One table's compiled state: what ``SlotTable`` keeps for a built-in policy.

The policy's arrays (``st``), the step's own (``sc``: counts, residency, used slots,
stamps, pins, the last step's outcome) and admission's (``adm``) live here for the
table's lifetime; each call hands them to the policy module's compiled entry point
(about 3 us to enter), so nothing is converted per step but the step's keys.
"""

from __future__ import annotations

import numpy as np

from . import admission_args, kernel_module, skeleton


class Kernel:
    """Compiled steps of one built-in eviction policy and one admission rule."""

    def __init__(self, policy, admission_cls, admission_params: dict, num_layers: int,
                 num_experts: int, parts: int, cap: int, top_k: int | None = None) -> None:
        self.module = kernel_module(type(policy))
        self.policy = policy
        self.L, self.E, self.parts, self.cap = num_layers, num_experts, parts, cap
        nkeys = num_layers * num_experts
        self.width = num_experts  # a step never needs more keys than a layer has experts
        self.sc = skeleton.scratch(num_layers, nkeys, parts, self.width)
        buffer = np.empty(self.width, np.int32)
        self.rows = [buffer[:n] for n in range(self.width + 1)]  # the step's keys, by count
        self.admission = Admission(admission_cls, admission_params, nkeys, parts, self.width,
                                   top_k)
        if admission_cls.needs_future:  # MIN with bypass: ties need the later uses (belady)
            policy.ties_by_future = True
        self.adm = self.admission.adm
        self.st = None if policy.needs_future else self._state()

    def _state(self) -> tuple:
        return self.module.state(self.policy, self.L * self.E, self.parts, self.cap, self.width)

    def bind_future(self, future) -> None:
        if self.policy.needs_future:
            self.policy.bind_future(future)
            self.st = self._state()
        self.admission.bind_future(future, self.L * self.E)
        self.adm = self.admission.adm

    @property
    def counts(self) -> np.ndarray:
        return self.sc[0]

    def pin(self, key: int, p: int) -> None:
        """``key`` resident for good in partition ``p``: counted as used, never shown to the
        policy."""
        self.sc[1][key] = self.sc[4][key] = True
        self.sc[2][p] += 1

    def step(self, keys: list[int], s: int, layer: int, token: int, phase: int,
             p: int) -> tuple[list[int], list[int]]:
        """One step over ``keys`` (unique, rank order); per key: IS_HIT / IS_LOAD / IS_BYPASS,
        and the key its load evicted (-1 none)."""
        n = len(keys)
        row = self.rows[n]      # a view kept per width: filling it beats building an array
        row[:] = keys
        self.module.step(row, s, layer, token, phase, p, self.cap, self.st, self.sc, self.adm)
        return self.sc[5][:, :n].tolist()

    def seed(self, keys: list[int], s: int) -> list[bool]:
        """Insert ``keys`` into free slots without counting; which ones went in."""
        loaded = np.zeros(len(keys), np.bool_)
        self.module.seed(np.asarray(keys, np.int32), loaded, s, self.parts, self.E, self.cap,
                         self.st, self.sc)
        return loaded.tolist()


class Admission:
    """A built-in admission rule's state, for tables whose eviction policy is a plug-in."""

    def __init__(self, admission_cls, admission_params: dict, nkeys: int, parts: int,
                 width: int = 1, top_k: int | None = None) -> None:
        # freq's 'narrow' 0: the table's top-k (one token's keys; 0 when unknown)
        narrow = int(admission_params.get("narrow", 0)) or (top_k or 0)
        self.args = (*admission_args(admission_cls, admission_params), width, narrow)
        self.nkeys, self.parts = nkeys, parts
        self.adm = self._state(None)

    def _state(self, future: tuple | None) -> tuple:
        rule, ghost, n_uses, window, reset, width, narrow = self.args
        return skeleton.admission_state(rule, self.nkeys, self.parts, ghost, n_uses, window,
                                        future, width, reset, narrow)

    def bind_future(self, future, nkeys: int) -> None:
        """The future an ``oracle`` rule reads (``policies.belady.Future``); a fresh state."""
        if self.args[0] == skeleton.ORACLE:
            self.adm = self._state(future.arrays(nkeys)[:2])

    def answers(self, keys: list[int], p: int, token: int) -> list[int]:
        """Record the step's accesses; per key NO / FREE_ONLY / YES, should it miss."""
        ok = np.empty(len(keys), np.int8)
        skeleton.admit_row(np.array(keys, np.int32), p, token, self.adm, ok)
        return ok.tolist()
