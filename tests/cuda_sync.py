"""Fail on any device-to-host sync inside a MoE step except the two the runtime means to make:
reading the router's choices (every step) and fetching the activations for a step that
computes experts on the host (only such a step)."""

from __future__ import annotations

import torch

from expertcache.runtime import experts as experts_mod


def forbid_syncs_in_steps(monkeypatch) -> dict:
    """Patch the runtime so a sync anywhere in ``run_step`` but ``_ids_to_host`` and
    ``_acts_to_host`` raises (sync debug mode 'error'); returns counters {'steps', 'to_host',
    'acts'} that fill as the model runs."""
    calls = {"to_host": 0, "acts": 0, "steps": 0}
    real_step = experts_mod.run_step

    def allowed(counter, real):
        def call(*args):
            calls[counter] += 1
            torch.cuda.set_sync_debug_mode(0)
            try:
                return real(*args)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        return call

    def run_step(*args):
        calls["steps"] += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_step(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(experts_mod, "_ids_to_host", allowed("to_host", experts_mod._ids_to_host))
    monkeypatch.setattr(experts_mod, "_acts_to_host", allowed("acts", experts_mod._acts_to_host))
    monkeypatch.setattr(experts_mod, "run_step", run_step)
    return calls
