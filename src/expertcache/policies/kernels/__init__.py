"""The built-in policies' logic, compiled (numba): one step (``skeleton``), one module of
hooks per policy, shared list and heap helpers.

A built-in policy class (``policies/lru.py``, ...) holds its name, parameters and their
checks, and names its hook module in the class attribute ``kernel`` (a string, so that
looking a policy up imports no numba). Both ``SlotTable`` (one step per call, through
``table.Kernel``) and the simulator (a whole trace per call) run that module: a policy's
logic is written once. A module's ``state(policy, nkeys, parts, cap, width)`` builds its
arrays from the policy's own attributes. Plug-in policies (no ``kernel``) run as Python
methods in ``SlotTable``.
"""

from __future__ import annotations

import importlib


def kernel_module(eviction_cls):
    """The hook module of a built-in eviction policy class, or None for a plug-in."""
    name = getattr(eviction_cls, "kernel", None)
    if name is None:
        return None
    return importlib.import_module(f"{__name__}.{name}")


def admission_args(admission_cls, params: dict) -> tuple:
    """``(rule, ghost, n_uses, window)`` for ``skeleton.admission_state``."""
    return (admission_cls.kernel, int(params.get("ghost", 1)), int(params.get("n", 1)),
            int(params.get("w", 1)))
