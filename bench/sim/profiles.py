"""The simulated GPU: step-time profiles and the engine limits (vLLM's engine arguments)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

DEFAULT_MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"

# Default KV-cache capacity, in tokens, for Llama-3.1-8B on one 80 GB GPU with vLLM's default
# gpu_memory_utilization=0.9: 0.9 * ~79.6 GiB usable = ~71.6 GiB, minus ~15 GiB of BF16 weights
# (8.03 B params), minus ~2-3 GiB of activations / CUDA graphs at 8192 batched tokens, leaves
# ~54 GiB for KV. One token of KV is 32 layers * 8 KV heads * 128 dims * 2 (K and V) * 2 bytes
# = 128 KiB, i.e. 8192 tokens per GiB, so ~54 GiB holds ~440k tokens (vLLM logs a "GPU KV cache
# size" of this order for this model on an H100 80 GB). The A100 80 GB profile uses the same.
DEFAULT_KV_CACHE_TOKENS: Final = 440_000
DEFAULT_MAX_MODEL_LEN: Final = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """A GPU/model step-time model: ``step = b0 + b1 * prefill_tokens + b2 * decode_tokens``."""

    name: str
    b0_s: float
    b1_s: float
    b2_s: float
    description: str = ""

    def step_time_s(self, *, prefill_tokens: int, decode_tokens: int) -> float:
        """Duration in simulated seconds of one engine step."""
        return self.b0_s + self.b1_s * prefill_tokens + self.b2_s * decode_tokens


PROFILES: Final[Mapping[str, Profile]] = {
    "h100": Profile(
        name="h100",
        b0_s=5.753e-3,
        b1_s=17.25e-6,
        b2_s=6.0e-6,
        description="Llama-3.1-8B on 1x H100, vLLM 0.8 (BLIS linear fit)",
    ),
    "a100": Profile(
        name="a100",
        b0_s=16.442e-3,
        b1_s=47.8e-6,
        b2_s=18.2e-6,
        description="Llama-3.1-8B on 1x A100 80 GB (BLIS linear fit)",
    ),
}


# A speed factor (``POST /sim/speed``) scales the GPU's speed: step
# times are divided by it. Above 10x the linear model means nothing.
MAX_SPEED_FACTOR: Final = 10.0


def check_speed_factor(factor: float) -> float:
    """``factor`` if it is a valid speed factor (> 0 and <= 10), else ValueError."""
    if not 0.0 < factor <= MAX_SPEED_FACTOR:  # also refuses NaN
        raise ValueError(f"speed factor must be > 0 and <= {MAX_SPEED_FACTOR:g}, got {factor!r}")
    return factor


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Scheduler limits (vLLM's engine arguments of the same names) and the step-time profile."""

    profile: Profile = PROFILES["h100"]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(
                "max_num_seqs, max_num_batched_tokens must be >= 1, max_model_len >= 2"
            )
        if self.max_model_len > self.kv_cache_tokens:
            # vLLM refuses to start in this case; it also guarantees the scheduler makes progress.
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache "
                f"({self.kv_cache_tokens} tokens)"
            )
