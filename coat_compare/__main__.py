"""``python -m coat_compare``: the same as the ``coat-compare`` command."""

import sys

from .job import main

if __name__ == "__main__":  # the checkpoint writer's worker processes re-import __main__
    sys.exit(main())
