"""Fail on any device-to-host sync inside a MoE step except reading the router's choices."""

from __future__ import annotations

import torch

from expertcache.runtime import experts as experts_mod


def forbid_syncs_in_steps(monkeypatch) -> dict:
    """Patch the runtime so a sync anywhere in ``run_step`` but ``_to_host`` raises (sync debug
    mode 'error'); returns counters {'steps', 'to_host'} that fill as the model runs."""
    calls = {"to_host": 0, "steps": 0}
    real_to_host, real_step = experts_mod._to_host, experts_mod.run_step

    def to_host(*args):
        calls["to_host"] += 1
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real_to_host(*args)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def run_step(*args):
        calls["steps"] += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_step(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(experts_mod, "_to_host", to_host)
    monkeypatch.setattr(experts_mod, "run_step", run_step)
    return calls
