"""The QaRL training loop, its checkpoints, logging and report (see :mod:`quarl.trainer.loop`)."""

from quarl.trainer.loop import Trainer, TrainingAborted

__all__ = ["Trainer", "TrainingAborted"]
