"""Stop a run cleanly on SIGUSR1, SIGTERM or SIGINT: checkpoint at the next step boundary, then exit 0.

Slurm sends SIGUSR1 ahead of a job's time limit (the rendered job's `--signal=B:USR1@S`, which
the batch script forwards to the learner step) and SIGTERM on preemption, `scancel` or the limit
itself; SIGINT is Ctrl-C (`sparserl train --nproc` forwards it to the ranks as it is, so the run
says which signal stopped it), and a second SIGINT interrupts at once. A signal can reach any subset
of the ranks, at any point of a step. So the handlers only
set a flag, and at every step boundary all ranks take one all-reduce (MAX) of their flags: they
agree to stop at the same step, whichever ranks saw the signal, and nothing is interrupted
half-way (a collective, a checkpoint write, an HTTP weight push).

Requeued jobs resume from that checkpoint through the loop's ordinary resume.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Context manager: while entered, the stop signals set `signum` instead of their default.

    Handlers can only be installed from the main thread (a Python rule); elsewhere the signals keep
    their previous behaviour and `agreed` still takes part in the collective (with flag 0).
    """

    def __init__(
        self, signals: Sequence[signal.Signals] = STOP_SIGNALS, *, ignore_after: bool = False
    ) -> None:
        """ignore_after: on exit, the stop signals other than SIGINT are ignored, not restored. The
        trainer's loop is then over, and what is left (closing engines, destroying process groups,
        the rank's exit record) must not be cut short by a late SIGTERM, e.g. torchrun repeating its
        stop request; the exit watchdog (`trainer.cli`) and torchrun's SIGKILL bound that teardown."""
        self.signals = tuple(signals)
        self.ignore_after = ignore_after
        self.signum = 0  # the first stop signal this process received, 0 for none
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            late = self.ignore_after and sig != signal.SIGINT
            signal.signal(sig, signal.SIG_IGN if late else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if signum == signal.SIGINT and self.signum == signal.SIGINT:  # Ctrl-C twice: do not wait
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def agreed(self, device: torch.device, group: Any = None) -> signal.Signals | None:
        """Collective over `group` (default: the world): the stop signal if any rank received one.

        With different signals on different ranks the numerically largest wins (SIGTERM over
        SIGUSR1 over SIGINT); every rank returns the same value.
        """
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        value = int(flag.item())
        return signal.Signals(value) if value else None
