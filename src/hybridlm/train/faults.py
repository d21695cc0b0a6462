"""Surviving the usual ends of a training job: a scheduler's SIGTERM, a user's Ctrl-C, and a loss that
turns NaN/Inf.

    with StopSignals() as stop:
        for step in ...:
            ...one full step...
            if stop.requested(world):      # every rank gets the same answer
                save(); break

The first SIGTERM or SIGINT only sets a flag, so the step in flight finishes and the loop saves a checkpoint
and leaves normally (exit 0); a second one raises KeyboardInterrupt at once. Under torchrun a signal may reach
one rank before the others, so `requested` all-reduces the flag (MAX) and all ranks stop after the same step.
"""
import math
import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager turning SIGTERM/SIGINT into a stop request (handlers restored on exit)."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.received is not None:  # asked twice: stop now
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def requested(self, world: int = 1, device: torch.device | str = "cpu") -> bool:
        """Whether any rank has received a stop signal (a collective when world > 1: call it on every rank)."""
        if world <= 1:
            return self.received is not None
        flag = torch.tensor(float(self.received is not None), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.received is None:
            self.received = "a signal on another rank"
        return bool(flag.item())


def finite(*values: float | None) -> bool:
    """True when every given value (loss, gradient norm; None = not measured) is finite."""
    return all(v is None or math.isfinite(v) for v in values)
