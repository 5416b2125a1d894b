"""`python -m harness` entry point.

The harness's SIGTERM handling (`harness.interrupts`) is in place before the command's imports (about 2 s of
torch, Megatron and Ray on a loaded 2-core host): a SIGTERM that came then used to end the process by the
signal (-15) with nothing written, where a caller expects 143. A SIGTERM in the first moments, before even
`harness.interrupts` is imported, is kept and raised once it is: nothing has started yet, and the process
ends with 143 and one line. A run interrupted before it made its results folder leaves no folder.
"""

import os
import signal
import sys

_early: list[int] = []  # a SIGTERM before the harness's own handler is in place
signal.signal(signal.SIGTERM, lambda signum, frame: _early.append(signum))

from harness import interrupts  # noqa: E402  (after the handler above)

interrupts.install()
try:
    if _early:
        interrupts.on_signal(signal.SIGTERM, None)
    from harness.cli import main, print_interrupt
except KeyboardInterrupt:
    print(f"interrupted by {interrupts.ended_by()}", file=sys.stderr)
    status = interrupts.exit_status()
    if status is None:  # SIGINT: end by it, as Python does after a KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(status)

sys.excepthook = print_interrupt  # an interrupted run ends with one line, not a traceback through its cleanup
sys.exit(main())
