"""Ctrl-C and SIGTERM during training, without losing a step or corrupting a run.

A signal in the middle of a step would leave the data position, the RNG and the
optimizer half-advanced, and a checkpoint written then could not be resumed exactly.
So the first SIGINT/SIGTERM only asks to stop: the loop finishes the step it is in,
saves and returns. A second one stops at once (``KeyboardInterrupt``) and writes
nothing; the last complete checkpoint is what ``--resume`` continues from, exactly as
after ``kill -9``.

A ``KeyboardInterrupt`` raised where Python cannot propagate it (inside a ``__del__``, a
garbage-collector or weakref callback) is printed as "Exception ignored ..." and lost:
the second Ctrl-C would print a traceback and not stop. While these handlers are
installed, such an interrupt is not printed but delivered again a moment later
(:func:`_redeliver_lost_interrupts`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """``with GracefulStop(lambda: step) as stop: while not stop.requested: ...``"""

    def __init__(self, current_step: Callable[[], int | None],
                 saved_step: Callable[[], int | None] = lambda: None) -> None:
        """current_step: the step in flight, None between steps; saved_step: the step of the
        run's last checkpoint, None while it has none."""
        self.current_step = current_step
        self.saved_step = saved_step
        self.requested = False
        self._old: dict[int, object] = {}
        self._hook = None

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._old = {s: signal.getsignal(s) for s in SIGNALS}
            for s in SIGNALS:
                signal.signal(s, self._handle)
            self._hook = _redeliver_lost_interrupts()
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            _LAST_SIGNAL[0] = signum
            raise KeyboardInterrupt
        self.requested = True
        step = self.current_step()
        doing = f"finishing step {step}, then saving" if step is not None else "saving"
        saved = self.saved_step()
        kept = (f"the checkpoint of step {saved} stays intact" if saved is not None
                else "no checkpoint has been written yet, so nothing of this run would be kept")
        msg = f"\ninterrupt ({signal.Signals(signum).name}): {doing} (press Ctrl-C again to stop now; {kept})\n"
        # os.write, not print: a handler that prints while the loop is printing raises "reentrant call"
        os.write(2, msg.encode())

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        _restore_unraisable_hook(self._hook)


class HardStop:
    """Signals raise KeyboardInterrupt at once (SIGTERM too): for work after the last save."""

    def __enter__(self) -> "HardStop":
        self._old = {}
        self._hook = None
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.getsignal(s) for s in SIGNALS}
            for s in SIGNALS:
                signal.signal(s, _raise_keyboard_interrupt)
            self._hook = _redeliver_lost_interrupts()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        _restore_unraisable_hook(self._hook)


_LAST_SIGNAL = [signal.SIGINT]  # the signal behind the last KeyboardInterrupt these handlers raised


def _raise_keyboard_interrupt(signum: int, frame) -> None:
    _LAST_SIGNAL[0] = signum
    raise KeyboardInterrupt


def _redeliver_lost_interrupts():
    """Install a ``sys.unraisablehook`` that, for a ``KeyboardInterrupt`` Python had to swallow,
    prints nothing and sends the same signal again 50 ms later (from a timer thread: sent from
    the hook itself, it could land in the hook and be swallowed again); other unraisable
    errors go to the hook that was there. Returns that hook, for :func:`_restore_unraisable_hook`."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            timer = threading.Timer(0.05, os.kill, (os.getpid(), _LAST_SIGNAL[0]))
            timer.daemon = True
            timer.start()
            return
        previous(unraisable)

    sys.unraisablehook = hook
    return previous


def _restore_unraisable_hook(previous) -> None:
    if previous is not None:
        sys.unraisablehook = previous
