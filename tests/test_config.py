"""shared/config.py: configs as command-line options, frozen once parsed."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from specmesh.services import cli
from specmesh.shared.config import add_dataclass_args, dataclass_from_args, option

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True)
class _Frozen:
    batch: int = option(4, "how many at once")


@dataclasses.dataclass
class _Mutable:
    batch: int = option(4, "how many at once")


def test_a_config_with_options_is_frozen_once_parsed() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, _Frozen)
    config = dataclass_from_args(_Frozen, parser.parse_args(["--batch", "8"]))
    assert config.batch == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch = 16  # type: ignore[misc]
    with pytest.raises(TypeError, match="_Mutable holds options: declare it"):
        add_dataclass_args(argparse.ArgumentParser(), _Mutable)


@pytest.mark.parametrize("command", ["up", "plan", "train-draft", "bench"])
def test_every_command_declares_its_options(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    assert "--" in capsys.readouterr().out
