"""`python -m harness` entry point."""

import sys

from harness.cli import main, print_interrupt

sys.excepthook = print_interrupt  # an interrupted run ends with one line, not a traceback through its cleanup
sys.exit(main())
