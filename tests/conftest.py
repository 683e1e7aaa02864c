"""Shared fixtures: the real routing traces in ../shared/traces (skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def shared_trace(name: str) -> Path:
    """Path of a file in ../shared/traces, or skip the test saying why."""
    path = SHARED_TRACES / name
    if not path.exists():
        pytest.skip(f"shared routing trace {path} is absent (tests read real traces from "
                    "../shared/traces next to the checkout; they are never copied into the repo)")
    return path


@pytest.fixture
def code_trace_path() -> Path:
    return shared_trace("qwen3-30b-a3b-code.npz")


@pytest.fixture
def general_trace_path() -> Path:
    return shared_trace("qwen3-30b-a3b-general.npz")
