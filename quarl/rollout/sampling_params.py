"""Per-request sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    ``n`` completions are drawn per prompt; they share the prompt's KV blocks.
    ``temperature == 0`` is greedy decoding. ``top_k <= 0`` and ``top_p == 1`` disable
    truncation. ``stop_token_ids`` end a completion (the stop token is kept, with its
    log-prob); the model's EOS ids are added unless ``ignore_eos``. ``seed`` makes the
    completions reproducible: sample ``j`` of a request uses the random stream
    ``(seed, j)``, independent of batch composition, preemption and graph use.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        """Whether top-k / top-p cut the distribution (greedy never needs it)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)
