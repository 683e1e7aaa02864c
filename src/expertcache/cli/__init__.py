"""The ``expertcache`` command: thin subcommands, one module each.

Each module in ``COMMANDS`` defines ``add_parser(subparsers)`` (which sets
``func`` on its parser) and keeps its work in library code. A ValueError from
the library is a user error: printed as one line, exit status 2.

Only the chosen subcommand's module is imported (the others appear in the
listing by their one-line help below), so ``expertcache --help`` and a
subcommand that needs no numpy, numba, matplotlib or torch pay for none of them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

# name -> one line for the command listing (the module's own parser says more)
COMMANDS = {
    "policies": "list eviction and admission policies with their parameters",
    "imatrix": ("what an imatrix (or trace, popularity JSON, .npy) says about each layer's "
                "experts, and which to place on the GPU"),
    "sim": "replay a routing trace: hit rates, optimum, predicted tok/s",
    "plan": "before loading: slots per slot format, predicted tok/s, a recommendation",
    "probe": "measure CPU matmul rate, memory and PCIe bandwidth into a profile for 'sim --hardware FILE'",
    "trace": "import, synthesise, inspect or record routing traces",
    "generate": "generate text with the expert cache and report speed and hits",
    "serve": "serve a model over an OpenAI-compatible HTTP API",
    "bench": "decode benchmark: baselines vs the cache on real expert weights",
    "demo": "simulator table + live benchmark on the built-in trace, with plots",
}


# The library speaks Python (``slots=N``); a CLI user reads the flags that set the same thing.
_SPELLING = [
    (re.compile(r"\bslots=N\b"), "--slots N"),
    (re.compile(r"\bgpu_memory='([^']*)'"), r"--gpu-memory \1"),
    (re.compile(r"\bgpu_memory=(\S+)"), r"--gpu-memory \1"),
    (re.compile(r"\bbaseline='resident' / 'cpu' / 'copy-every-pass'"), "--baseline resident, cpu or copy-every-pass"),
    (re.compile(r"\bbaseline '(\S+)'"), r"--baseline \1"),
    (re.compile(r"\bbaseline='([^' ]+)'"), r"--baseline \1"),
    (re.compile(r"\bgive slots or gpu_memory\b"), "give --slots or --gpu-memory"),
    (re.compile(r"\ba smaller gpu_memory or fewer slots\b"), "a smaller --gpu-memory or fewer --slots"),
    (re.compile(r"\bslot_format='(\S+)'"), r"--slot-format \1"),
    (re.compile(r"\bcpu_kernel='(\S+)'"), r"--cpu-kernel \1"),
    (re.compile(r"\bcpu_graph='(\S+)'"), r"--cpu-graph \1"),
    (re.compile(r"\bcpu_repack='(\S+)'"), r"--cpu-repack \1"),
    (re.compile(r"^(slots|staging|port) must\b"), r"--\1 must"),
    (re.compile(r"^(max_body_bytes|max_tokens|max_queue|max_prompt_tokens) must\b"),
     lambda m: "--" + m.group(1).replace("_", "-") + " must"),
    (re.compile(r"\bgive either slots or gpu_memory\b"), "give either --slots or --gpu-memory"),
    (re.compile(r"\bgive at least (\d+) slots\b"), r"give at least --slots \1"),
]


def cli_spelling(message: str) -> str:
    """``message`` with the library's keyword spelling turned into the CLI's flags."""
    for pattern, repl in _SPELLING:
        message = pattern.sub(repl, message)
    return message


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser; given ``argv``, only the command it names is built in full."""
    parser = argparse.ArgumentParser(
        prog="expertcache",
        description="A persistent GPU expert cache for Mixture-of-Experts models: "
                    "simulate policies on routing traces, run models, benchmark.")
    from .. import __version__
    parser.add_argument("--version", action="version", version=f"expertcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    for name, text in COMMANDS.items():
        if chosen is None or name == chosen:
            importlib.import_module(f"{__name__}.{name.replace('-', '_')}").add_parser(sub)
        else:
            sub.add_parser(name, help=text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
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
        print(f"expertcache {args.command}: error: {cli_spelling(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
