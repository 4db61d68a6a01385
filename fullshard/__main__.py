"""``python -m fullshard ...``: the same as the ``fullshard`` console script."""

import sys

from .cli.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
