"""What the stages of a training step hand each other, and the clock that times them.

rollout (prompts -> completions -> rewards)  ->  :class:`Rollout`
advantages (group-relative or GAE)           ->  ``RolloutBatch`` (the scored batch)
update (old / ref log-probs, the loss)       ->  :class:`UpdateResult` (and an :class:`ErrorScan`)
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from quarl.rollout import Completion


@dataclass
class Rollout:
    """A step's prompts, their ``n`` completions each (sorted by prompt, then sample) and
    the completions' rewards ``[len(prompts) * n]``."""

    prompts: list[list[int]]
    examples: list[Any]
    completions: list[Completion]
    rewards: torch.Tensor
    reward_metrics: dict[str, float]
    generated_tokens: int

    def select(self, groups: list[int], n: int) -> "Rollout":
        """The prompt groups ``groups`` (each prompt with its ``n`` completions), renumbered."""
        comps = [dataclasses.replace(c, prompt_index=new)
                 for new, g in enumerate(groups) for c in self.completions[g * n:(g + 1) * n]]
        rows = torch.tensor([g * n + j for g in groups for j in range(n)], dtype=torch.long)
        return Rollout([self.prompts[g] for g in groups], [self.examples[g] for g in groups], comps,
                       self.rewards[rows], self.reward_metrics, self.generated_tokens)

    def extend(self, other: "Rollout") -> "Rollout":
        """This rollout's groups followed by ``other``'s (metrics and token count stay this one's)."""
        shift = len(self.prompts)
        comps = self.completions + [dataclasses.replace(c, prompt_index=c.prompt_index + shift)
                                    for c in other.completions]
        return Rollout(self.prompts + other.prompts, self.examples + other.examples, comps,
                       torch.cat([self.rewards, other.rewards]), self.reward_metrics, self.generated_tokens)


@dataclass
class UpdateResult:
    """The learner's update metrics, the sampler/learner mismatch it measured, and its work:
    ``tokens`` through forward + backward, ``extra_forwards`` forward-only passes over them
    (old / reference log-probs, critic values)."""

    metrics: dict[str, float]
    mismatch: dict[str, float]
    tokens: int = 0
    extra_forwards: int = 0

    def model_flops(self, matmul_params: int, lora_params: int | None = None) -> float:
        """``(6 + 2 * extra_forwards) * P * tokens`` (forward 2 P T, backward 4 P T). A LoRA
        learner (``lora_params``: the adapters' parameters) computes no weight gradient of its
        frozen base: ``(4 + 2 e) P T`` for the base plus ``(6 + 2 e) P_lora T``."""
        e = 2 * self.extra_forwards
        if lora_params is None:
            return (6 + e) * matmul_params * self.tokens
        return ((4 + e) * matmul_params + (6 + e) * lora_params) * self.tokens


@dataclass
class ErrorScan:
    """Where the update's truncation at error tokens (``algo.truncate_at_error``) found each
    response's first loop and first garbled token (``[B]``) over the response mask ``mask``;
    the step's ``errors/*`` metrics reuse them when they scan the same rows."""

    mask: torch.Tensor
    loops: torch.Tensor
    garbled: torch.Tensor


_OPEN: list[str] = []  # the stages open now in this process, outermost first


def current_stage() -> str | None:
    """The innermost stage open now in this process (``"learner"``, ``"rollout"``, ...; None
    between steps): what a benchmark's GPU clock sampler tags its readings with."""
    return _OPEN[-1] if _OPEN else None


class StageClock:
    """Wall time (``time/<stage>``, summed over repeats, each stage waiting for its own GPU work)
    and, for stages asked to, peak CUDA memory (``memory/<stage>_peak_gb``) and the caching
    allocator's retries (``memory/<stage>_alloc_retries``: allocations that had to free cached
    blocks and try again, each a device synchronisation; non-zero means the stage runs at the
    memory limit) of one step's stages."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.peak_gb: dict[str, float] = {}
        self.retries: dict[str, float] = {}
        self.out_of_memory: str | None = None  # the innermost stage that ran out of GPU memory

    @contextmanager
    def stage(self, name: str, memory: bool = False) -> Iterator[None]:
        if memory and self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            retries0 = _alloc_retries(self.device)
        t0 = time.perf_counter()
        _OPEN.append(name)
        try:
            yield
        except torch.OutOfMemoryError:
            self.out_of_memory = self.out_of_memory or name
            raise
        finally:
            if self.cuda:  # the stage's queued kernels count as its own, not the next stage's
                torch.cuda.synchronize(self.device)
            _OPEN.pop()
            self.seconds[name] += time.perf_counter() - t0
            if memory and self.cuda:
                self.peak_gb[name] = torch.cuda.max_memory_allocated(self.device) / 2**30
                self.retries[name] = float(_alloc_retries(self.device) - retries0)

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory/{k}_peak_gb": v for k, v in self.peak_gb.items()})
        out.update({f"memory/{k}_alloc_retries": v for k, v in self.retries.items()})
        return out


def _alloc_retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
