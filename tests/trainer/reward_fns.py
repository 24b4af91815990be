"""Reward functions for trainer tests (importable by the reward pool's workers)."""

from __future__ import annotations

import os
import time

from quarl.tasks.synthetic import arith_reward


def hang_once(completion: str, answer: str, meta: dict) -> float:
    """The arithmetic verifier, except that the very first call (across all workers) hangs."""
    marker = os.environ["QUARL_TEST_HANG_MARKER"]
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return arith_reward(completion, answer, meta)
    os.close(fd)
    time.sleep(3600)
    return 0.0


def digit_one(completion: str, answer: str, meta: dict) -> float:
    """1.0 when the completion contains the character '1': a signal even an untrained model gets."""
    return 1.0 if "1" in completion else 0.0


def always_raises(completion: str, answer: str, meta: dict) -> float:
    """A broken verifier: fails on every item."""
    raise KeyError("gold_answer")


_calls = 0


def raises_after_16_calls(completion: str, answer: str, meta: dict) -> float:
    """Scores one step of 4 prompts x 4 samples (inline, workers=0), then breaks."""
    global _calls
    _calls += 1
    if _calls > 16:
        raise KeyError("gold_answer")
    return 0.0


def even_length(completion: str, answer: str, meta: dict) -> float:
    """1.0 for a completion of even length: right about half the time, whatever the model."""
    return 1.0 if len(completion) % 2 == 0 else 0.0


_CALLS = [0]


def rank_one_dies_in_step_two(completion: str, answer: str, meta: dict) -> float:
    """``digit_one``, except that rank 1 of a 2-rank run (4 prompts x 4 samples a step: 8
    completions a rank) exits at its first completion of step 2, as a crashed process would."""
    _CALLS[0] += 1
    if os.environ.get("RANK") == "1" and _CALLS[0] > 8:
        os._exit(7)
    return digit_one(completion, answer, meta)


def rank_one_disk_full_at_second_save(completion: str, answer: str, meta: dict) -> float:
    """``digit_one``; on rank 1 of a sharded run, the second checkpoint's write of its shards
    fails as a full disk would (inside ``torch.distributed.checkpoint.save``, after the ranks
    have agreed on what each writes)."""
    import errno

    import torch.distributed.checkpoint as dcp

    if os.environ.get("RANK") == "1" and not getattr(dcp.save, "patched", False):
        real, saves = dcp.save, [0]

        class FullDisk(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                raise OSError(errno.ENOSPC, "No space left on device")

        def save(state_dict, *, checkpoint_id=None, **kw):
            saves[0] += 1
            if saves[0] == 2:
                return real(state_dict, storage_writer=FullDisk(checkpoint_id), **kw)
            return real(state_dict, checkpoint_id=checkpoint_id, **kw)

        save.patched = True
        dcp.save = save
    return digit_one(completion, answer, meta)


def rank_zero_disk_full_at_second_save(completion: str, answer: str, meta: dict) -> float:
    """``digit_one``; on rank 0 of a sharded run, the second checkpoint's ``state.pt`` cannot be
    written (a full disk), after every rank has written its shards."""
    import errno

    from quarl.trainer import checkpoint

    if os.environ.get("RANK") == "0" and not getattr(checkpoint._write_complete, "patched", False):
        real, saves = checkpoint._write_complete, [0]

        def write(tmp, step, state, fresh=True):
            saves[0] += 1
            if saves[0] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(tmp, step, state, fresh)

        write.patched = True
        checkpoint._write_complete = write
    return digit_one(completion, answer, meta)


def always_hangs(completion: str, answer: str, meta: dict) -> float:
    """A verifier stuck on every item (a pathological simplification, a dead service)."""
    time.sleep(3600)
    return 0.0


def hangs_once_marked(completion: str, answer: str, meta: dict) -> float:
    """``digit_one`` until the file named by QUARL_TEST_HANG_MARKER exists, then stuck."""
    if os.path.exists(os.environ["QUARL_TEST_HANG_MARKER"]):
        time.sleep(3600)
    return digit_one(completion, answer, meta)


_FLAKY = [0]


def flaky(completion: str, answer: str, meta: dict) -> float:
    """``digit_one``, but 2 of every 5 calls (in each process) raise: a verifier failing on 40% of items."""
    _FLAKY[0] += 1
    if _FLAKY[0] % 5 in (1, 3):
        raise ValueError("flaky")
    return digit_one(completion, answer, meta)


def raises_after_32_calls(completion: str, answer: str, meta: dict) -> float:
    """``digit_one`` for two steps of 4 prompts x 4 samples (inline, workers=0), then broken:
    the evaluation after step 2 finds it failing on every item."""
    _FLAKY[0] += 1
    if _FLAKY[0] > 32:
        raise KeyError("gold_answer")
    return digit_one(completion, answer, meta)
