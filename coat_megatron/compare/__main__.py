"""``python -m coat_megatron.compare``: the same as the ``coat-compare`` command."""

import sys

from .job import main

sys.exit(main())
