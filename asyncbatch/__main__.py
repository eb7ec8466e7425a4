"""``python -m asyncbatch``: the ``asyncbatch`` command."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
