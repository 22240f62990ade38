"""The learner service's own options (besides speculation's): where versions persist and
how it trains."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specmesh.shared.config import device_option, model_option, option

DEFAULT_ONLINE_DIR = Path.home() / ".cache" / "specmesh" / "online"


@dataclass(frozen=True)
class LearnerConfig:
    """The target (its embeddings serve the head) and the device; training is float32."""

    model: str | None = model_option()
    device: str | None = device_option()


@dataclass(frozen=True)
class OnlineLearningConfig:
    """How the learner trains and keeps versions (`specmesh up` passes them on)."""

    speculative_online_dir: str = option(
        str(DEFAULT_ONLINE_DIR),
        "the learner's head versions and state (a restarted pool resumes the latest); a "
        "head checkpoint moved into <dir>/<algorithm>/incoming/ is pushed to the pool",
    )
    speculative_online_buffer_size: int = option(1024, "served requests kept to train on")
    speculative_online_heldout_share: float = option(
        0.1, "share of prompts (by a hash of their ids) held out to judge new versions"
    )
    speculative_online_min_examples: int = option(
        16, "new training examples that start a round of training"
    )
    speculative_online_round_steps: int = option(
        20, "optimizer steps per round; then held-out acceptance decides on publishing"
    )
    speculative_online_min_gain: float = option(
        0.02, "held-out acceptance a candidate must gain over the pool's version"
    )
    speculative_online_lr: float = option(2e-4, "learning rate")
    speculative_online_rollback_steps: int = option(
        1000, "verification steps of live acceptance before a new version is judged"
    )
    speculative_online_rollback_margin: float = option(
        0.1, "live acceptance length a new version may lose against its parent"
    )

    def checked(self) -> OnlineLearningConfig:
        if not 0.0 < self.speculative_online_heldout_share < 1.0:
            raise ValueError("--speculative-online-heldout-share must be in (0, 1)")
        counts = (
            self.speculative_online_buffer_size,
            self.speculative_online_min_examples,
            self.speculative_online_round_steps,
            self.speculative_online_rollback_steps,
        )
        if min(counts) < 1:
            raise ValueError(
                "--speculative-online-buffer-size, -min-examples, -round-steps and "
                "-rollback-steps must be >= 1"
            )
        return self
