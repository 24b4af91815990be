"""What the loop does when a step's verifier or an evaluation fails, so that no trained step is lost.

* The verifier fails on a whole batch (:class:`~quarl.tasks.rewards.RewardFailed`) or a stop
  is asked for while it hangs (:class:`~quarl.tasks.rewards.ScoringInterrupted`): both
  happen while the step's rollout is scored, before the learner is touched. The step is
  rolled back to where it started (data position, random state) and the last complete
  step is checkpointed, so a resume repeats the failed step exactly
  (:func:`rolled_back_on_verifier_failure`).
* An evaluation fails after its step trained: the step is logged and checkpointed, then
  :class:`EvaluationFailed` says what failed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from quarl.tasks.rewards import RewardError, ScoringInterrupted
from quarl.trainer import checkpoint as ckpt


class EvaluationFailed(RuntimeError):
    """The evaluation after a step failed; the step itself is logged and checkpointed."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step = step
        super().__init__(f"the evaluation after step {step} failed ({type(error).__name__}: {first_line(error)})")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextlib.contextmanager
def rolled_back_on_verifier_failure(prompts: Any, step: int, saved_step: Callable[[], int | None],
                                    save: Callable[[], Any], run_dir: Any) -> Iterator[None]:
    """Around training step ``step + 1``: if scoring its rollout fails or is interrupted, put
    the data position (``prompts.position``) and random state back as they were before the
    step, checkpoint the last complete step with ``save`` unless ``saved_step()`` says it is
    saved (none before step 1: nothing to keep) and re-raise (a verifier failure with where
    the run stands added to its message)."""
    data_pos, rng = prompts.position, ckpt.rng_state()
    try:
        yield
    except (RewardError, ScoringInterrupted) as e:
        prompts.position = data_pos
        ckpt.set_rng_state(rng)
        if step > 0 and saved_step() != step:
            save()
        if isinstance(e, ScoringInterrupted):
            raise
        saved = saved_step()
        kept = (f"the checkpoint of step {saved} is saved: once the verifier is fixed, continue with "
                f"quarl train --resume --trainer.run_dir={run_dir}" if saved is not None else "no step was trained")
        raise type(e)(f"step {step + 1}: {e}; {kept}") from e


def budget_advice(packing: Any, cuda: bool) -> str | None:
    """What to change when the learner's micro-batches hold one row each: the learner's own
    advice (GPU only: on the CPU a micro-batch's host work is not what limits it), and on any
    device a token budget smaller than one row, which every micro-batch then exceeds."""
    advice = packing.advice() if cuda else None
    if advice or packing.micro_batches == 0 or packing.budget >= packing.longest:
        return advice
    larger = -(-2 * packing.longest // 256) * 256
    return (f"trainer.token_budget={packing.budget} is smaller than one row ({packing.longest} tokens): every "
            "micro-batch holds a single row, over the budget, and the learner pays its host work per micro-batch: "
            f"--trainer.token_budget={larger} would hold two rows where memory allows")
