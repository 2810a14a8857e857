"""``python -m tinyloop``: the ``tinyloop`` command (tinyloop/cli.py)."""

import sys

from .cli import main

sys.exit(main())
