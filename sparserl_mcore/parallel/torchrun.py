"""torchrun (`torch.distributed.run`), told once that the process that launched it is gone.

`launch` starts torchrun with a parent-death signal, so a launcher killed outright still gets its
ranks stopped cleanly (they finish the step, write a stop checkpoint, exit 0; torchrun SIGKILLs
them 30 s later if not). Linux sends that signal each time a parent *thread* of the child exits,
so a killed launcher with several threads sent it two or three times within 0.1 s. torchrun's
first SIGTERM starts that graceful stop; a second one, arriving during it, makes torchrun give up
and exit, and its ranks die with it (SIGKILL, `rank_entry.die_with_parent`) mid-checkpoint, their
work since the last checkpoint lost.

So torchrun's parent-death signal is `PARENT_GONE`, which this entry turns into one SIGTERM, once.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

PARENT_GONE = signal.SIGUSR2  # neither torchrun nor the ranks use it


def _stop_once() -> None:
    """Handle PARENT_GONE: the first delivery raises SIGTERM in this process (torchrun's own
    handler then stops the ranks), later ones are ignored."""

    def on_parent_gone(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        signal.signal(PARENT_GONE, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(PARENT_GONE, on_parent_gone)


def main() -> None:
    _stop_once()
    from torch.distributed.run import main as torchrun_main

    sys.argv[0] = "torchrun"
    torchrun_main()


if __name__ == "__main__":
    main()
