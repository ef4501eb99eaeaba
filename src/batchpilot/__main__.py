"""``python -m batchpilot``: the same as the ``batchpilot`` command."""

import sys

from .cli import main

sys.exit(main())
