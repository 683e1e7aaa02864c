"""The bench table printed to the terminal (rich), one row per strategy."""

from __future__ import annotations


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(doc: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 130))
    t = Table(title=f"{doc['model']} x{doc.get('scale', 1):g}: {doc['layers']} layers x "
                    f"{doc['num_experts']} experts, top-{doc['top_k']}, "
                    f"{doc['expert_bytes'] / 2**20:.2f} MiB/expert, {doc['tokens']} decode tokens, "
                    f"{doc['device']}", title_justify="left")
    t.caption = (f"{doc.get('clock', 'wall')} clock; ms/token of the MoE part; cold: first 16 tokens, "
                 "warm: to N/4, steady: the rest; "
                 "pred: cost model (steady); other: time outside expert math and copies")
    for col in ("strategy", "slots", "hit rate", "cold", "warm", "steady", "tok/s", "pred",
                "pred/meas", "H2D MiB/tok", "pool MiB", "other"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for r in doc["results"]:
        name = r["strategy"] if r["strategy"] != "cache" else f"cache {r['policy']}"
        if r.get("skipped"):
            t.add_row(name, _f(r["slots"], "d"), *(["-"] * 9), "skipped")
            continue
        ms = r["ms_per_token"]
        h2d = r["h2d_bytes_per_token"]
        t.add_row(name, _f(r["slots"], "d"), _f(r["hit_rate"], ".3f"), _f(ms["cold"], ".2f"),
                  _f(ms["warm"], ".2f"), _f(ms["steady"], ".2f"), _f(r["tok_s"], ".1f"),
                  _f(r["predicted_ms_per_token"], ".2f"), _f(r["predicted_ratio"], ".2f"),
                  _f(None if h2d is None else h2d / 2**20, ".1f"), _f(r["slot_bytes"] / 2**20, ".0f"),
                  _f(r.get("overhead_share"), ".1%"))
    console.print(t)
    from .report import resident_note

    for note in [*doc.get("notes", []), resident_note(doc["results"])]:
        if note:
            console.print(f"note: {note}")
