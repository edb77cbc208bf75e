"""python -m dorafp8.kernel_report (cli.py)."""

import sys

from .cli import main

sys.exit(main())
