"""A rich progress bar with the numbers an RL engineer watches: reward, mismatch, speed."""

from __future__ import annotations


class StepProgress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> "StepProgress":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, m: dict[str, float]) -> None:
        if self._progress is None:
            return
        info = (
            f"reward {m.get('reward/mean', float('nan')):.3f}  "
            f"kl3 {m.get('mismatch/kl_k3', float('nan')):.2e}  "
            f"{m.get('rollout/tokens_per_s', 0.0):.0f} tok/s"
        )
        if "eval/acc" in m:
            info += f"  eval {m['eval/acc']:.3f}"
        self._progress.update(self._task, completed=step, info=info)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
