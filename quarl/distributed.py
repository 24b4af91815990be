"""Several processes, one run: the ranks of a data-parallel job on ``torch.distributed``.

A run launched with ``torchrun`` (one process per GPU, or several CPU processes on gloo)
finds its rank and world size in the environment (:func:`from_env`). Each rank samples
its own share of a step's prompts (a prompt's group of samples never splits across ranks),
so a step's batch is the union of the ranks' shares; the learner normalises its loss by the
totals over all ranks and sums the gradients across them, so every rank takes the same
optimizer step as one process on the whole batch would.

:class:`Dist` is the small state every part asks: which rank am I, how many are there, and
the few collectives the step needs. ``Dist()`` is the single process: every collective is
the identity, nothing is imported or initialised.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass

import torch

# how long a collective may wait for a rank that stopped answering before the others fail
TIMEOUT = datetime.timedelta(minutes=10)
# a GPU job's process group: GPU tensors on NCCL; CPU tensors, and so every object collective
# (pickled values: the checkpoint's planning, the ranks' rollouts), on gloo. Object collectives
# over NCCL stage through GPU memory, and the gathers and scatters of torch.distributed.checkpoint
# open NCCL point-to-point channels whose buffers NCCL allocates outside torch's cache: on a
# GPU that the learner and the KV cache fill, that allocation can hang the save.
BACKEND_GPU = "cuda:nccl,cpu:gloo"
# the most gradient bytes one flat all-reduce buffer holds
BUCKET_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: ``rank`` of ``world`` (``world == 1``: one process)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that logs, writes the report and checkpoints, and prints progress."""
        return self.rank == 0

    def share(self, count: int, what: str = "prompts per step", fix: str = "trainer.prompts_per_step") -> range:
        """This rank's contiguous share of ``count`` items, equal on every rank; a count the
        ranks cannot split evenly is refused (naming the setting to change)."""
        if count % self.world:
            raise ValueError(f"{count} {what} cannot be split evenly over {self.world} ranks: set {fix} to a "
                             f"multiple of {self.world} (the world size), or launch a number of ranks that divides "
                             f"{count}")
        k = count // self.world
        return range(self.rank * k, (self.rank + 1) * k)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=_device())
        torch.distributed.all_reduce(t)
        return t.tolist()

    def max(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def sum_tensor_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks, in place."""
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t

    def sum_grads_(self, params, bucket_bytes: int | None = None) -> None:
        """Every parameter's gradient summed over the ranks, in place. Small gradients travel
        together in flat buckets of at most ``bucket_bytes`` (one collective each instead of
        one per tensor, and never a copy of all of them at once: a 7B model's fp32 gradients
        take 28 GB); a gradient as large as a bucket is reduced where it lies. A parameter that
        has a gradient on some rank but not on this one sends zeros; one without a gradient on
        every rank keeps none (the optimizer skips it, as it would in one process)."""
        if self.world == 1:
            return
        params = list(params)
        if not params:
            return
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=_device())
        torch.distributed.all_reduce(has)
        grads = []
        for p, n in zip(params, has.tolist()):
            if n:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        for bucket in buckets(grads, BUCKET_BYTES if bucket_bytes is None else bucket_bytes):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                torch.distributed.all_reduce(bucket[0])
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            torch.distributed.all_reduce(flat)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


class DeviceTimer:
    """Time spent in blocks of queued GPU work (collectives, whose time includes waiting for the
    slowest rank), without a synchronisation of its own: CUDA events around each block, read
    by :meth:`take` once the caller has synchronised anyway. On CPU (gloo, synchronous) the
    host's clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list = []
        self.seconds = 0.0

    @contextlib.contextmanager
    def timed(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - t0

    def take(self) -> float:
        """Seconds since the last take (waits for the blocks' GPU work to finish)."""
        total = self.seconds
        for start, end in self.events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        self.events, self.seconds = [], 0.0
        return total


def buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, cut into runs of one dtype and device whose bytes stay within
    ``limit``; a tensor of ``limit`` bytes or more is a run of its own."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        fits = (last is not None and last[0].dtype == t.dtype and last[0].device == t.device
                and size + nbytes <= limit and nbytes < limit)
        if fits:
            last.append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out


def _device() -> torch.device:
    """Where this rank's tensor collectives run: its GPU with NCCL, the CPU with gloo alone."""
    if "nccl" in torch.distributed.get_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def from_env(device: str = "auto") -> Dist:
    """The job this process belongs to, from ``torchrun``'s environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``): initialises the process group once (on GPUs NCCL for
    tensors and gloo for objects, :data:`BACKEND_GPU`; gloo on CPU) and binds the rank to GPU
    ``LOCAL_RANK``. Without those variables: one process, ``Dist()``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    rank = int(os.environ["RANK"])
    threads = cpu_threads(os.environ)
    if threads is not None:
        torch.set_num_threads(threads)
    gpu = device != "cpu" and torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if gpu:
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank} wants GPU {local} but this node has {torch.cuda.device_count()}: launch "
                               f"at most {torch.cuda.device_count()} processes per node (torchrun --nproc_per_node)")
        torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        bound = {"device_id": torch.device("cuda", local)} if gpu else {}  # (NCCL: this rank's GPU, no guessing)
        torch.distributed.init_process_group(BACKEND_GPU if gpu else "gloo", timeout=TIMEOUT, **bound)
    return Dist(rank=torch.distributed.get_rank(), world=torch.distributed.get_world_size())


def rank_cores(env: dict[str, str] | os._Environ | None = None, cores: int | None = None) -> int:
    """This rank's share of the node's CPU ``cores`` (those this process may run on by
    default): ``cores // LOCAL_WORLD_SIZE``, at least 1 (all of them outside torchrun)."""
    env = os.environ if env is None else env
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, cores // max(1, int(env.get("LOCAL_WORLD_SIZE", "1"))))


def cpu_threads(env: dict[str, str] | os._Environ, cores: int | None = None) -> int | None:
    """The intra-op CPU threads for a rank: :func:`rank_cores` where ``OMP_NUM_THREADS`` is
    unset or 1, which is what torchrun sets when it is unset (one thread makes the ranks'
    CPU work many times slower); None (keep it) where it is set to anything else."""
    if env.get("OMP_NUM_THREADS", "1") != "1":
        return None
    return rank_cores(env, cores)


def shutdown() -> None:
    """Leave the job's process group (at the end of a run; nothing without one)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def leave(code: int) -> None:
    """End a rank of a finished job: meet the other ranks, leave the process group, and exit
    with ``code`` without the interpreter's teardown, where torch's gloo threads can abort a
    rank that has finished (failing the torchrun job). Files must be written and closed."""
    import sys

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.barrier()
        finally:
            shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
