"""The ``expertcache`` command: thin subcommands, one module each.

Each module in ``COMMANDS`` defines ``add_parser(subparsers)`` (which sets
``func`` on its parser) and keeps its work in library code. A ValueError from
the library is a user error: printed as one line, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = ("policies", "imatrix", "sim", "plan", "probe", "trace", "generate", "serve", "bench", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertcache",
        description="A persistent GPU expert cache for Mixture-of-Experts models: "
                    "simulate policies on routing traces, run models, benchmark.")
    from .. import __version__
    parser.add_argument("--version", action="version", version=f"expertcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name.replace('-', '_')}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
        return code
    except BrokenPipeError:
        # the reader went away (`expertcache trace info X | head`): what it wanted was printed.
        # Python's documented way: point stdout at devnull so the exit flush stays quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, FileNotFoundError, TypeError) as err:
        print(f"expertcache {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
