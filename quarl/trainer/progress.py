"""Progress of a loop of steps, with the numbers an RL engineer watches.

On a terminal: a rich progress bar. Anywhere else (CI, nohup, ``| tee``) a bar would
print nothing useful, so a plain line goes out on the first step, the last step and
every ``max(1, total // 20)`` steps between (10-20 lines for any run length), each
with step/total, the step's numbers, the mean step time and the time left.
"""

from __future__ import annotations

import time
from typing import Callable

Describe = Callable[[dict[str, float]], str]


def describe_rl_step(m: dict[str, float]) -> str:
    info = f"reward {m.get('reward/mean', float('nan')):.3f}  kl3 {m.get('mismatch/kl_k3', float('nan')):.2e}"
    if "eval/acc" in m:
        info += f"  eval {m['eval/acc']:.3f}"
    return info


def describe_loss(m: dict[str, float]) -> str:
    return f"loss {m.get('loss', float('nan')):.4f}"


class StepProgress:
    """``with StepProgress(total, start, console) as p: ... p.update(step, metrics)``.

    console: a rich Console, or None for no output at all (``--quiet``).
    """

    def __init__(self, total: int, start: int = 0, console=None, label: str = "train",
                 describe: Describe = describe_rl_step) -> None:
        self.total, self.start, self.console, self.label, self.describe = total, start, console, label, describe
        self.every = max(1, total // 20)
        self._progress = None
        self._task = None
        self._t0 = time.perf_counter()

    def __enter__(self) -> "StepProgress":
        self._t0 = time.perf_counter()
        if self.console is not None and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn(f"[bold]{self.label}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task(self.label, total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, m: dict[str, float]) -> None:
        if self._progress is not None:
            info = self.describe(m)
            if "rollout/tokens_per_s" in m:
                info += f"  {m['rollout/tokens_per_s']:.0f} tok/s"
            self._progress.update(self._task, completed=step, info=info)
        elif self.console is not None and (step == self.start + 1 or step == self.total or step % self.every == 0):
            self.console.print(self.plain_line(step, m), markup=False, highlight=False, soft_wrap=True)

    def plain_line(self, step: int, m: dict[str, float]) -> str:
        done = max(step - self.start, 1)
        per_step = (time.perf_counter() - self._t0) / done
        eta = per_step * max(self.total - step, 0)
        return (f"{self.label} step {step}/{self.total}  {self.describe(m)}  "
                f"{per_step:.2f} s/step  eta {_duration(eta)}")

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"
