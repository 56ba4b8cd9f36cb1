"""``python -m ember ...``: the same as the ``ember`` command."""

import sys

from ember.cli import main

if __name__ == "__main__":
    sys.exit(main())
