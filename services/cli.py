"""`specmesh`: start the system, fetch the default model."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from shared.config import add_dataclass_args, dataclass_from_args
from shared.engine.engine import EngineConfig
from shared.speculative.config import SpeculativeConfig


def _up(args: argparse.Namespace) -> None:
    import uvicorn

    from services.gateway.app import build_app
    from shared.engine.async_engine import AsyncEngine
    from shared.engine.engine import LLMEngine
    from shared.tokenizer import Tokenizer

    spec = dataclass_from_args(SpeculativeConfig, args).resolved()  # fail before loading
    args.model = str(_model_dir(args.model))
    cfg = dataclass_from_args(EngineConfig, args)
    engine = AsyncEngine(LLMEngine(cfg, spec))
    name = args.served_model_name or cfg.model.rstrip("/").rsplit("/", 1)[-1]
    app = build_app(engine, Tokenizer(cfg.model), name)
    print(f"specmesh serving {name} at http://{args.host}:{args.port}/v1", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()


def _model_dir(model: str | None) -> Path:
    """The HF directory to serve: the default model (fetched on first use), a GGUF file
    converted once into the cache (serving needs its tokenizer files), or `model` itself."""
    from shared.config import cache_dir
    from shared.model.fetch import convert_gguf, fetch_default_model, is_complete

    if model is None:
        return fetch_default_model()
    if not model.endswith(".gguf"):
        return Path(model)
    dest = cache_dir() / "models" / Path(model).stem
    return dest if is_complete(dest) else convert_gguf(model, dest, progress=True)


def _fetch_model(args: argparse.Namespace) -> None:
    from shared.model.fetch import ModelFetchError, fetch_default_model

    try:
        print(fetch_default_model(args.dest))
    except ModelFetchError as exc:
        sys.exit(f"specmesh fetch-model: {exc}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="serve the OpenAI API on the embedded default")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--served-model-name", default=None, help="model id in the API")
    add_dataclass_args(up, EngineConfig)
    add_dataclass_args(up, SpeculativeConfig)
    up.set_defaults(run=_up)

    fetch = commands.add_parser("fetch-model", help="fetch and convert the default model")
    fetch.add_argument("--dest", default=None, help="directory (default: the specmesh cache)")
    fetch.set_defaults(run=_fetch_model)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except ValueError as exc:  # a bad option combination: say so, no traceback
        parser.exit(2, f"specmesh {args.command}: error: {exc}\n")


if __name__ == "__main__":
    main()
