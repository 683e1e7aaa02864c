"""Exact numba kernels: one step loop (``skeleton``), one module of hooks per policy.

A built-in policy names its kernel module in its class attribute ``kernel`` (a
string, so ``policies/`` imports no numba); the module's ``run(prep, policy, parts,
cap, admission)`` reads the policy's own parameters from a fresh instance. An
admission policy's ``kernel`` is the code the step loop compiles in for it. A
kernel applies to a class only if the class inherits its hooks unchanged from the
class that declared the kernel (a subclass that overrides one replays through
``SlotTable``). tests/test_sim_fast.py holds every kernel equal to ``SlotTable``.
"""

from __future__ import annotations

import importlib
import importlib.util

# The methods a kernel reproduces; a class may list more it depends on (``kernel_mirrors``),
# such as next-use's ``_use``.
EVICTION_HOOKS = ("on_insert", "on_access", "on_remove", "victim")
ADMISSION_HOOKS = ("record", "admit")


def declared_kernel(cls, hooks: tuple[str, ...]):
    """``cls.kernel`` if ``cls`` has the hooks of the class that declared it, else None."""
    owner = next((c for c in cls.__mro__ if "kernel" in vars(c)), None)
    if owner is None:
        return None
    mirrored = hooks + tuple(getattr(owner, "kernel_mirrors", ()))
    if any(getattr(cls, f, None) is not getattr(owner, f, None) for f in mirrored):
        return None
    return vars(owner)["kernel"]


def have_numba() -> bool:
    """numba comes with the ``sim`` extra; without it every replay runs through SlotTable."""
    return importlib.util.find_spec("numba") is not None


def kernel_module(eviction_cls, admission_cls):
    """The kernel module reproducing this pair of policy classes, or None."""
    if not have_numba():
        return None
    name = declared_kernel(eviction_cls, EVICTION_HOOKS)
    if name is None or declared_kernel(admission_cls, ADMISSION_HOOKS) is None:
        return None
    return importlib.import_module(f"{__name__}.{name}")


def admission_args(admission_cls, params: dict) -> tuple:
    """``(admit, ghost, n_uses, window)`` for the step loop."""
    return (admission_cls.kernel, int(params.get("ghost", 1)), int(params.get("n", 1)),
            int(params.get("w", 1)))
