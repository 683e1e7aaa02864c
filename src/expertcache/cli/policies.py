"""``expertcache policies [--json]``: every registered eviction and admission policy."""

from __future__ import annotations

import json

from ..policies.registry import admission_policies, eviction_policies


def add_parser(sub) -> None:
    p = sub.add_parser("policies", help="list eviction and admission policies with their parameters")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def describe() -> dict:
    def rows(table):
        return [{"name": name, "description": cls.description, "params": dict(cls.params)}
                for name, cls in table.items()]
    return {"eviction": rows(eviction_policies()), "admission": rows(admission_policies())}


def run(args) -> int:
    info = describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for kind in ("eviction", "admission"):
        table = Table(title=f"{kind} policies", title_justify="left")
        for col in ("name", "parameters", "description"):
            table.add_column(col)
        for row in info[kind]:
            params = ", ".join(f"{k}={v}" for k, v in row["params"].items()) or "-"
            table.add_row(row["name"], params, row["description"])
        console.print(table)
    return 0
