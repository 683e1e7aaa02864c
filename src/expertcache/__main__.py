"""``python -m expertcache ...``: the ``expertcache`` command, for where its script is not on
PATH (a virtual environment not activated, a notebook's ``!python -m expertcache ...``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
