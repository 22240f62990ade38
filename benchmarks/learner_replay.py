"""The online learner's training, replayed offline: which options learn most per second?

    python benchmarks/learner_replay.py EXAMPLES [--seconds 200] [--every 20]
        [--options root_fraction=0.25 root_fraction=0.1 lr=8e-4 ...]
        [--labels emitted distribution]

EXAMPLES: the `examples.jsonl` a learner keeps (`<--speculative-online-dir>/eagle3/`,
e.g. bench_online.py's), the tokens of the requests a pool served. They are restored as
a restarted learner restores them (one target pass for their features), then, per
options (`OnlineOptions` fields, comma-separated), the shipped EAGLE-3 head trains on
them from scratch with the same seed for `--seconds` of optimizer steps, printing the
held-out acceptance (the learner's own judge) every `--every` steps and at the end, and
how long judging took. Options are compared at equal training seconds, run one after
another on a quiet machine; judging is not counted in them.

`--labels distribution` also trains each options set on the target's whole distribution
after each position (soft labels, from a second target pass), where `emitted` (what a
learner has) is the token the target emitted: what decode's top-k would add.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from specmesh.shared.model.fetch import fetch_default_model
from specmesh.shared.model.loader import load_model
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.training.features import TargetView, extract
from specmesh.shared.training.online import (
    Example,
    OnlineOptions,
    OnlineTrainer,
    online_trainer,
)


def parse(options: str) -> OnlineOptions:
    fields = (pair.split("=") for pair in options.split(","))
    return OnlineOptions(**{name: type(getattr(OnlineOptions, name))(v) for name, v in fields})


def train(trainer: OnlineTrainer, label: str, seconds: float, every: int) -> None:
    """`seconds` of optimizer steps; prints the held-out acceptance every `every` steps."""
    spent, step = 0.0, 0
    while spent < seconds:
        start = time.perf_counter()
        loss = trainer.train_step()
        spent += time.perf_counter() - start
        step += 1
        if step % every == 0 or spent >= seconds:
            start = time.perf_counter()
            acceptance = trainer.heldout_acceptance(trainer.draft)
            judged = time.perf_counter() - start
            print(
                f"{label:<28} step {step:4d}  {spent:6.1f} s  loss {loss:.3f}  "
                f"held-out {acceptance:.3f} (judged in {judged:.1f} s)",
                flush=True,
            )


def with_distribution(trainer: OnlineTrainer) -> list[Example]:
    """The trainer's training examples labelled with the target's distribution: its final
    states, from a target pass."""
    examples = list(trainer.train_set)
    samples = [e.sample for e in examples]
    finals = extract(trainer.target, samples, *trainer.target_features, store_dtype=torch.float16)
    return [
        Example(e.sample, TargetView(e.view.features, v.final, e.view.argmax), e.serial)
        for e, v in zip(examples, finals, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("examples", type=Path)
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--options", nargs="+", default=["root_fraction=0.25", "root_fraction=0.1"])
    parser.add_argument(
        "--labels", nargs="+", choices=["emitted", "distribution"], default=["emitted"]
    )
    args = parser.parse_args()
    model = fetch_default_model()
    head = SpeculativeConfig(speculative_algorithm="EAGLE3").resolved().speculative_draft_model_path
    target = load_model(str(model), torch.device("cpu"), torch.float32).requires_grad_(False)
    config = json.loads((model / "config.json").read_text())

    def shipped(options: OnlineOptions) -> OnlineTrainer:
        return online_trainer("EAGLE3", target, options, Path(head or ""), config, None)

    served = shipped(OnlineOptions())
    start = time.perf_counter()
    restored = served.restore_examples(args.examples)
    print(
        f"restored {restored} examples ({len(served.heldout)} held out) in "
        f"{time.perf_counter() - start:.0f} s; the shipped head's held-out acceptance "
        f"{served.heldout_acceptance(served.draft):.3f}",
        flush=True,
    )
    train_sets = {"emitted": list(served.train_set)}
    if "distribution" in args.labels:
        train_sets["distribution"] = with_distribution(served)
    for options in args.options:
        for labels in args.labels:
            trainer = shipped(parse(options))  # the same seed each time
            trainer.train_set.extend(train_sets[labels])
            trainer.heldout = served.heldout
            train(trainer, f"{options} {labels}", args.seconds, args.every)


if __name__ == "__main__":
    main()
