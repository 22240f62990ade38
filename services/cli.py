"""`specmesh`: start the system, fetch the default model, train drafters, benchmark."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from specmesh.services.decode.config import DecodeConfig
from specmesh.services.gateway.config import GatewayConfig
from specmesh.services.launcher import Configs, Launcher, UpConfig
from specmesh.services.learner.config import OnlineLearningConfig
from specmesh.services.prefill.config import PrefillConfig
from specmesh.services.tokenizer.config import TokenizerConfig
from specmesh.shared.bus import NatsAuth
from specmesh.shared.config import (
    HelpFormatter,
    SGLangFlags,
    add_dataclass_args,
    dataclass_from_args,
)
from specmesh.shared.engine.engine import EngineConfig
from specmesh.shared.logs import LogConfig, configure_logging
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.transport import TransportConfig

_UP_CONFIGS = {
    "up": UpConfig,
    "gateway": GatewayConfig,
    "engine": EngineConfig,
    "spec": SpeculativeConfig,
    "transport": TransportConfig,
    "decode": DecodeConfig,
    "prefill": PrefillConfig,
    "tokenizer": TokenizerConfig,
    "online": OnlineLearningConfig,
    "nats": NatsAuth,
    "sglang": SGLangFlags,
}


def _up(args: argparse.Namespace) -> None:
    from specmesh.shared.model.fetch import resolve_model
    from specmesh.shared.speculative.factory import drafter_target_features

    given = {name: dataclass_from_args(cls, args) for name, cls in _UP_CONFIGS.items()}
    model = str(resolve_model(given["engine"].model))  # fetch once, not per service
    configs = Configs(**{**given, "engine": dataclasses.replace(given["engine"], model=model)})
    if configs.spec.enabled:  # a bad combination or draft head fails before anything starts
        drafter_target_features(configs.spec.resolved(model), model)
    sys.exit(Launcher(configs).run())


def _plan(args: argparse.Namespace) -> None:
    from specmesh.services.planner import PlanConfig, measure, report

    cfg = dataclass_from_args(PlanConfig, args)
    print(report(measure(cfg, dataclass_from_args(NatsAuth, args)), cfg))


def _fetch_model(args: argparse.Namespace) -> None:
    from specmesh.shared.model.fetch import ModelFetchError, fetch_default_model

    try:
        print(fetch_default_model(args.dest))
    except ModelFetchError as exc:
        sys.exit(f"specmesh fetch-model: {exc}")


def _config_command(
    commands: argparse._SubParsersAction,
    name: str,
    help: str,
    config: type,
    run: Callable[[Any], object],
) -> argparse.ArgumentParser:
    """A subcommand whose options are `config`'s fields; it calls `run` with that config."""
    parser = commands.add_parser(name, help=help, formatter_class=HelpFormatter)
    add_dataclass_args(parser, config)
    parser.set_defaults(run=lambda args: run(dataclass_from_args(config, args)))
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser(
        "up",
        help="start NATS, the KV store and every service locally",
        formatter_class=HelpFormatter,
    )
    for cls in _UP_CONFIGS.values():
        add_dataclass_args(up, cls)
    up.set_defaults(run=_up)

    fetch = commands.add_parser("fetch-model", help="fetch and convert the default model")
    fetch.add_argument("--dest", default=None, help="directory (default: the specmesh cache)")
    fetch.set_defaults(run=_fetch_model)

    from specmesh.services.draft_sweep import DraftSweepConfig, sweep
    from specmesh.shared.training.train_draft import TrainDraftConfig, train_draft

    train = _config_command(
        commands,
        "train-draft",
        "train a drafter (EAGLE/EAGLE-3 head, NEXTN layer, DFLASH block draft, STANDALONE "
        "draft LM) for a target",
        TrainDraftConfig,
        lambda cfg: print(train_draft(cfg)),
    )
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="benchmark", required=True
    )
    bench_spec = _config_command(
        bench,
        "speculative",
        "sweep each algorithm's draft shape over prompt sets; print the best per workload",
        DraftSweepConfig,
        sweep,
    )

    from specmesh.services.planner import PlanConfig

    plan = commands.add_parser(
        "plan",
        help="measure the live load; print how many decode workers and drafters it needs",
        formatter_class=HelpFormatter,
    )
    add_dataclass_args(plan, PlanConfig)
    add_dataclass_args(plan, NatsAuth)
    plan.set_defaults(run=_plan)

    for command in (up, fetch, train, bench_spec, plan):
        add_dataclass_args(command, LogConfig)
    args = parser.parse_args(argv)
    try:
        logs = dataclass_from_args(LogConfig, args)
        configure_logging("specmesh", logs.log_level, logs.log_format)
        os.environ.update(logs.environ())  # the services `up` starts log alike (service_main)
        args.run(args)
    except (ValueError, ConnectionError) as exc:  # bad options, unreachable servers: no traceback
        parser.exit(2, f"specmesh {args.command}: error: {exc}\n")


if __name__ == "__main__":
    main()
