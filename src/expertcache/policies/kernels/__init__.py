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
import importlib.util


def have_numba() -> bool:
    """numba is a dependency; a broken or stripped install replays through plug-ins only."""
    return importlib.util.find_spec("numba") is not None


# The Python methods a plug-in writes; a built-in's are its compiled hooks.
HOOKS = ("on_insert", "on_access", "on_remove", "victim", "record", "admit")


def compiled(cls) -> bool:
    """Whether ``cls`` is a built-in (its ``kernel`` runs it). A subclass of a built-in that
    writes a hook method of its own is refused: the compiled logic would silently ignore
    it, and the built-in has no Python methods left to inherit."""
    if getattr(cls, "kernel", None) is None:
        return False
    owner = next(c for c in cls.__mro__ if "kernel" in vars(c))
    changed = [f for f in HOOKS if getattr(cls, f, None) is not getattr(owner, f, None)]
    if changed:
        raise TypeError(f"{cls.__name__} overrides {', '.join(changed)} of the built-in "
                        f"{owner.__name__}, whose logic is compiled (policies/kernels): derive "
                        "a plug-in from EvictionPolicy or AdmissionPolicy instead")
    return True


def kernel_module(eviction_cls):
    """The hook module of a built-in eviction policy class, or None for a plug-in."""
    if not compiled(eviction_cls):
        return None
    return importlib.import_module(f"{__name__}.{eviction_cls.kernel}")


def admission_args(admission_cls, params: dict) -> tuple:
    """``(rule, ghost, n_uses, window, reset)`` for ``skeleton.admission_state`` (an oracle rule's
    future comes later, with ``bind_future``)."""
    return (admission_cls.kernel, int(params.get("ghost", 1)), int(params.get("n", 1)),
            int(params.get("w", 1)), int(params.get("reset", 1)))
