"""``python -m base_moe COMMAND ...``: see :mod:`base_moe.cli`."""

import sys

from .cli import main

sys.exit(main())
