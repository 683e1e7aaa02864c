"""The step loop every eviction kernel shares, written once (numba).

A kernel replays step keys ``int32 [S, W]`` (-1 = padding or a repeat) exactly as
``SlotTable._step`` does: per step its keys are protected (``stamp[key] == s``);
per key, admission records the access, a resident key is a hit, a miss takes a free
slot or the policy's victim (or is bypassed: every resident key protected, or
admission said no), then the key is inserted. The counts come back as
``int64 [2, L, 6]`` (phase, layer, ``stats.FIELDS``), the layout ``stats.Stats`` wraps.

A policy's kernel module holds its state as a tuple ``st`` of arrays (``STATE``
names them, in order) and four hooks, the calls ``SlotTable`` makes on
``EvictionPolicy``, each taking the state arrays as trailing arguments:

- ``on_hit(key, p, s, j, *state)``: ``on_access`` (``p`` partition, ``s`` step,
  ``j`` the key's column, for kernels that read per-access arrays such as next uses);
- ``find_victim(p, s, stamp, *state) -> key or -1``: ``victim``, a pure query that
  never picks a key with ``stamp[key] == s``;
- ``on_evict(key, p, *state)``: ``on_remove``;
- ``on_insert(key, p, s, j, *state)``: ``on_insert``.

``specialize(globals(), name)`` at the end of the module compiles this loop with
those hooks inlined into ``name``, cached as if it were written in the policy's
module: numba's cache then recompiles when the policy's kernel file changes, and
its key holds this loop's bytecode, so a change here recompiles every kernel too.
(Helpers imported from a third file, such as ``lists.py`` or ``heap.py``, are not
tracked by numba's cache: clear the kernels' ``__pycache__`` after editing one.)

Admission is compiled in, chosen per run by ``admit`` (``AdmissionPolicy.kernel``):
``ALWAYS``; ``SECOND_HIT`` keeps a ghost LRU list of ``ghost`` keys per partition,
touched by every access; ``WINDOW`` admits a key used ``n_uses`` times within its
layer's last ``window`` steps. Either only decides when the miss would evict.
"""

from __future__ import annotations

import inspect
import textwrap

import numpy as np
from numba import njit

ALWAYS, SECOND_HIT, WINDOW = 0, 1, 2
ACC, HIT, MISS, LOAD, EVICT, BYPASS = range(6)


def scratch(L: int, nkeys: int, parts: int, admit: int, n_uses: int) -> tuple:
    """The step loop's own arrays, allocated here: the loop runs without numba's
    reference counting (``specialize``), so it allocates nothing itself."""
    ghosts = nkeys if admit == SECOND_HIT else 1
    window = nkeys if admit == WINDOW else 1
    return (np.zeros((2, L, 6), np.int64),         # counts
            np.zeros(nkeys, np.bool_),             # resident
            np.zeros(parts, np.int64),             # used slots per partition
            np.full(nkeys, -1, np.int32),          # stamp: step that last needed the key
            # second-hit: a ghost LRU list per partition, oldest first
            np.full(ghosts, -1, np.int32), np.full(ghosts, -1, np.int32),
            np.full(parts, -1, np.int32), np.full(parts, -1, np.int32),
            np.zeros(parts, np.int64), np.zeros(ghosts, np.bool_),
            # window: the last n_uses use times (the layer's step count) per key, as a ring
            np.full((window, n_uses), -(1 << 40), np.int64), np.zeros(window, np.int64))


def run(replay, prep, parts: int, cap: int, st: tuple, admission: tuple):
    """Counts ``int64 [2, L, 6]`` of a specialized loop (``replay``, from ``specialize``) over
    ``prep``'s steps; ``admission`` is ``(admit, ghost, n_uses, window)``."""
    admit, ghost, n_uses, window = admission
    sc = scratch(prep.L, prep.L * prep.E, parts, admit, n_uses)
    replay(admit)(prep.keys, prep.phases, prep.L, parts, cap, st, sc, admit, ghost, n_uses, window)
    return sc[0]


def _replay(keys, phases, L, parts, cap, st, sc, admit, ghost, n_uses, window_steps):
    STATE = st  # specialize() unpacks the policy's state here, once, into its STATE names
    (counts, resident, used, stamp, gprev, gnext, ghead, gtail, gsize, in_ghost,
     uses, nuse) = sc
    K = keys.shape[1]
    layer, token = L - 1, -1
    for s in range(keys.shape[0]):
        if layer == L - 1:                           # layer = s % L, token = s // L (the
            layer, token = 0, token + 1              # layer's own step count), no division
        else:
            layer += 1
        p = 0 if parts == 1 else layer
        row = keys[s]
        for j in range(K):
            if row[j] >= 0:
                stamp[row[j]] = s
        acc = hit = evict = bypass = 0
        for j in range(K):
            key = row[j]
            if key < 0:
                continue
            acc += 1
            ok = True  # admission's answer should this access miss with the pool full
            if admit == SECOND_HIT:
                ok = in_ghost[key]
                if ok:  # unlink from the ghost list (re-appended below)
                    a, b = gprev[key], gnext[key]
                    if a >= 0:
                        gnext[a] = b
                    else:
                        ghead[p] = b
                    if b >= 0:
                        gprev[b] = a
                    else:
                        gtail[p] = a
                else:
                    in_ghost[key] = True
                    gsize[p] += 1
                t = gtail[p]
                gprev[key], gnext[key] = t, -1
                if t >= 0:
                    gnext[t] = key
                else:
                    ghead[p] = key
                gtail[p] = key
                if gsize[p] > ghost:  # forget the oldest ghost
                    old = ghead[p]
                    ghead[p] = gnext[old]
                    gprev[gnext[old]] = -1  # ghost > 0, so old is not the only entry
                    in_ghost[old] = False
                    gsize[p] -= 1
            elif admit == WINDOW:
                n = nuse[key]
                uses[key, n % n_uses] = token
                nuse[key] = n + 1
                # n_uses uses within the window iff the oldest in the ring is in it
                ok = uses[key, (n + 1) % n_uses] > token - window_steps
            if resident[key]:
                hit += 1
                on_hit(key, p, s, j, *STATE)  # noqa: F821 (the policy module's hook)
                continue
            if used[p] < cap:
                used[p] += 1
            else:
                victim = find_victim(p, s, stamp, *STATE)  # noqa: F821
                if victim < 0 or not ok:  # all protected, or admission said no
                    bypass += 1
                    continue
                on_evict(victim, p, *STATE)  # noqa: F821
                resident[victim] = False
                evict += 1
            on_insert(key, p, s, j, *STATE)  # noqa: F821
            resident[key] = True
        tally(counts[phases[s], layer], acc, hit, bypass, evict)


ADMISSION_NAMES = {ALWAYS: "always", SECOND_HIT: "second_hit", WINDOW: "window"}


def specialize(module_globals: dict, name: str):
    """The step loop compiled with the hooks of the module whose ``globals()`` is given:
    a function of the admission code that returns the compiled loop for it.

    The module's ``STATE`` names its state arrays in the order of ``st``: the loop
    unpacks them once and hands them to the hooks as plain arguments. A module that
    needs numba's reference counting (it allocates inside the loop) sets ``NRT = True``.
    Each admission rule gets its own loop, compiled on first use, with the rule a
    constant: the branches of the other rules vanish (about 15% of a plain LRU run).
    The code is compiled under the policy module's file name, which is what numba's
    cache keys on (with the bytecode, so edits to this loop recompile too).
    """
    state = module_globals["STATE"]
    clash = set(state) & set(_replay.__code__.co_varnames)
    if clash:  # the unpacked state would overwrite the loop's own variables
        raise ValueError(f"{module_globals['__name__']}.STATE reuses the step loop's names "
                         f"{sorted(clash)}: rename them")
    names = ", ".join(state)
    template = textwrap.dedent(inspect.getsource(_replay))
    template = template.replace("STATE = st", f"{names}, = st").replace("*STATE", names)
    env = dict(_replay.__globals__)
    for hook_name in ("on_hit", "find_victim", "on_evict", "on_insert"):
        env[hook_name] = module_globals[hook_name]
    loops: dict[int, object] = {}

    def loop(admit: int):
        if admit not in loops:
            fname = f"{name}_{ADMISSION_NAMES[admit]}"
            src = template.replace("def _replay(", f"def {fname}(", 1)
            src = src.replace("admit == SECOND_HIT", f"{admit} == SECOND_HIT")
            src = src.replace("admit == WINDOW", f"{admit} == WINDOW")
            space = dict(env)
            exec(compile(src, module_globals["__file__"], "exec"), space)
            fn = space[fname]
            fn.__module__ = module_globals["__name__"]
            # Without reference counting (numba's ``_nrt`` option): the hooks take the state
            # arrays as arguments, and counting each in and out per access made the loop
            # 3-10x slower.
            loops[admit] = njit(cache=True, _nrt=module_globals.get("NRT", False))(fn)
        return loops[admit]
    return loop


@njit(inline="always")
def tally(c, acc, hit, bypass, evict):
    """One step's counts into its (phase, layer) row, in ``stats.FIELDS`` order."""
    c[ACC] += acc
    c[HIT] += hit
    c[MISS] += acc - hit
    c[LOAD] += acc - hit - bypass
    c[EVICT] += evict
    c[BYPASS] += bypass


def hook(fn):
    """Decorator for a policy's hooks: compiled into the step loop (no call, no refcounts)."""
    return njit(inline="always")(fn)
