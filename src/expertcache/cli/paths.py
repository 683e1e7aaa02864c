"""Output paths, checked before any work starts, by one rule for every subcommand.

Every file a subcommand writes (``--json``, ``--plot``, ``-o``) goes into a folder that
must already exist: nothing creates it. A typo in a path then costs a one-line error
at once, not a finished run with nowhere to put its results, and no stray folders
appear. ``demo --out DIR`` names the folder for its own files: demo creates that one
folder, never missing folders above it.
"""

from __future__ import annotations

from pathlib import Path


def check_output(path: str | Path | None, flag: str) -> None:
    """Refuse an output file whose folder is missing (``None`` and ``-`` for stdout pass)."""
    if path is None or str(path) == "-":
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    _check_folder(path.parent, f"{flag} {path}")


def check_output_dir(path: str | Path, flag: str) -> None:
    """Refuse an output folder that is a file or whose parent folder is missing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder")
    _check_folder(path.parent, f"{flag} {path}")


def _check_folder(folder: Path, what: str) -> None:
    if not folder.is_dir():
        raise ValueError(f"{what}: folder {folder} does not exist; create it first "
                         "(expertcache creates no folders for output files)")
