"""What a run tells its user while it builds and trains: progress lines and warnings.

A :class:`Notices` is handed to every stage that has something to say, so that none of them
needs the trainer to print: ``say`` goes to the console (nowhere with ``--quiet`` or on a rank
other than 0), ``warn`` is printed even with ``--quiet`` (to stderr without a console), on
rank 0 alone.
"""

from __future__ import annotations

import sys


class Notices:
    """``console``: a rich Console (None: quiet, or a rank that does not print); ``main``: this
    process is the run's rank 0."""

    def __init__(self, console=None, main: bool = True) -> None:
        self.console = console
        self.main = main
        self._warned: set[str] = set()

    def say(self, msg: str) -> None:
        if self.console is not None:
            self.console.print(msg)

    def warn(self, msg: str) -> None:
        """Printed even with --quiet: the user must know (a skipped checkpoint, a changed setting)."""
        if not self.main:
            return
        if self.console is not None:
            self.console.print(f"[yellow]{msg}[/yellow]")
        else:
            print(msg, file=sys.stderr)

    def warn_once(self, key: str, msg: str) -> None:
        """:meth:`warn` the first time ``key`` is warned about in this run, then never again."""
        if key not in self._warned:
            self._warned.add(key)
            self.warn(msg)
