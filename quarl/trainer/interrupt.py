"""Ctrl-C and SIGTERM during training, without losing a step or corrupting a run.

A signal in the middle of a step would leave the data position, the RNG and the
optimizer half-advanced, and a checkpoint written then could not be resumed exactly.
So the first SIGINT/SIGTERM only asks to stop: the loop finishes the step it is in,
saves and returns. A second one stops at once (``KeyboardInterrupt``) and writes
nothing; the last complete checkpoint is what ``--resume`` continues from, exactly as
after ``kill -9``.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """``with GracefulStop(lambda: step) as stop: while not stop.requested: ...``"""

    def __init__(self, current_step: Callable[[], int | None]) -> None:
        """current_step: the step in flight, None between steps."""
        self.current_step = current_step
        self.requested = False
        self._old: dict[int, object] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._old = {s: signal.getsignal(s) for s in SIGNALS}
            for s in SIGNALS:
                signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        step = self.current_step()
        doing = f"finishing step {step}, then saving" if step is not None else "saving"
        msg = (f"\ninterrupt ({signal.Signals(signum).name}): {doing} "
               "(press Ctrl-C again to stop now; the last checkpoint stays intact)\n")
        # os.write, not print: a handler that prints while the loop is printing raises "reentrant call"
        os.write(2, msg.encode())

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


class HardStop:
    """Signals raise KeyboardInterrupt at once (SIGTERM too): for work after the last save."""

    def __enter__(self) -> "HardStop":
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.getsignal(s) for s in SIGNALS}
            for s in SIGNALS:
                signal.signal(s, _raise_keyboard_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def _raise_keyboard_interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt
