"""docs/policies.md's custom-policy example runs exactly as written, registers a
working policy, and stays about 20 lines."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from expertcache import SlotTable
from expertcache.policies import registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "policies.md"
SECTION = "## A complete custom policy"


def example_code() -> str:
    text = DOC.read_text()
    assert SECTION in text, f"{DOC} lost its section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section should hold exactly one python block"
    return blocks[0]


@pytest.fixture
def doc_policy():
    before = set(registry.eviction_policies())
    namespace: dict = {"__name__": "policies_doc_example"}
    exec(compile(example_code(), str(DOC), "exec"), namespace)  # its own asserts run here
    added = set(registry.eviction_policies()) - before
    yield added
    for name in added:  # keep the registry as other tests expect it
        registry._EVICTION.pop(name)


def test_example_runs_and_registers_one_policy(doc_policy):
    assert doc_policy == {"doc-lru2"}


def test_the_documented_policy_beats_lru_where_the_doc_says(doc_policy):
    """The example's point: on 0 0 1 2 0 with two slots, LRU-2 evicts 1 (used once) for 2 and
    hits 0 again; LRU evicts 0 (least recent) and misses it. Both run here, side by side."""
    seen = {}
    for name in ("doc-lru2", "lru"):
        table = SlotTable(1, 8, 2, eviction=name)
        for expert in [0, 0, 1, 2]:
            table.step(0, [expert])
        kept = sorted(table.resident())  # keys = expert ids in a one-layer table
        table.step(0, [0])
        seen[name] = (kept, table.stats().total().hits)
    assert seen == {"doc-lru2": ([0, 2], 2), "lru": ([1, 2], 1)}


def test_example_policy_keeps_the_table_contract(doc_policy):
    rng = random.Random(0)
    table = SlotTable(2, 6, 4, eviction="doc-lru2", top_k=3)
    for _ in range(500):
        layer, experts = rng.randrange(2), rng.sample(range(6), rng.randint(1, 3))
        before = table.resident()
        plan = table.step(layer, experts)
        keys = {layer * 6 + e for e in experts}
        assert not set(plan.evictions) & keys and len(table.resident()) <= 4
        assert set(plan.hits) | set(plan.loads) == keys
        assert all(table.slot_of(k) == s for k, s in before.items() if k not in plan.evictions)


def test_example_is_about_twenty_lines():
    code = example_code()
    policy = code.split("@register", 1)[1].split("\n\n\n", 1)[0]
    lines = [ln for ln in policy.splitlines() if ln.strip()]
    assert len(lines) <= 25, len(lines)
