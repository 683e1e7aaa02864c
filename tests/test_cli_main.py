"""What every ``expertcache`` subcommand shares: help texts, and a reader that leaves early."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from expertcache.cli import COMMANDS, build_parser
from expertcache.trace import save_trace, synth_trace

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _subparser(name: str):
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices[name]


# `policies` is left out until its module gets a description (cli/policies.py is edited elsewhere)
DESCRIBED = [c for c in COMMANDS if c != "policies"]


@pytest.mark.parametrize("name", DESCRIBED)
def test_every_subcommand_has_a_description_printed_as_written(name):
    sub = _subparser(name)
    text = sub.format_help()
    assert sub.description and len(sub.description) > 40, f"{name} --help has no description"
    assert "%%" not in text, f"{name} --help shows a doubled percent sign"


def test_a_closed_pipe_ends_quietly(tmp_path):
    """``expertcache trace info X | head -1``: no BrokenPipeError traceback on stderr."""
    path = tmp_path / "t.npz"
    save_trace(synth_trace("olmoe", 50), path)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from expertcache.cli import main; "
                             "sys.exit(main(sys.argv[1:]))", "trace", "info", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the first line is written: every write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("argv", [
    ["bench", "--json", "{missing}/b.json"],
    ["bench", "--plot", "{missing}/b.png"],
    ["imatrix", "{absent}", "--json", "{missing}/i.json"],
    ["imatrix", "{absent}", "--plot", "{missing}/i.png"],
    ["probe", "-o", "{missing}/hw.json"],
    ["demo", "--out", "{missing}/demo"],
], ids=lambda argv: " ".join(argv[:2]))
def test_an_output_into_a_missing_folder_fails_first(argv, tmp_path, capsys):
    """One rule everywhere (cli/paths.py): the folder must exist, nothing creates it, and
    the check comes before the run (the input here does not even exist)."""
    from expertcache.cli import main

    names = {"missing": str(tmp_path / "nope"), "absent": str(tmp_path / "absent.gguf")}
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"folder {tmp_path / 'nope'} does not exist" in err and err.count("\n") == 1, err
    assert not (tmp_path / "nope").exists()


def test_errors_use_the_cli_spelling(capsys):
    """A CLI user reads --slots / --gpu-memory, not the library's slots=N (issue 17)."""
    from expertcache.cli import cli_spelling, main

    assert main(["generate", "nowhere", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--slots N or --gpu-memory 8GiB" in err and "slots=N" not in err
    assert "--baseline resident, cpu or copy-every-pass" in err
    assert cli_spelling("capacity below top-k: gpu_memory='64MiB' holds 3 experts") == \
        "capacity below top-k: --gpu-memory 64MiB holds 3 experts"
    assert cli_spelling("x needs 3 GiB; give a smaller gpu_memory or fewer slots") == \
        "x needs 3 GiB; give a smaller --gpu-memory or fewer --slots"
    assert cli_spelling("max_tokens must be a positive whole number, got 0") == \
        "--max-tokens must be a positive whole number, got 0"
    assert cli_spelling("the pool holds 3 slots but one step needs up to top_k=4; give at least 4 slots") \
        .endswith("give at least --slots 4")
