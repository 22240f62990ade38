"""scripts/compose-local's command line (`python -m specmesh.services.compose_local`)."""

from __future__ import annotations

import argparse
import sys

from specmesh.services.compose_local import stack
from specmesh.services.compose_local.docker import DockerError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/compose-local",
        description="docker-compose.yml run on this machine: images built from Debian's and "
        "PyPI's packages (no container registry needed), deploy/compose.local.yml on top.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up",
        help="build what is missing, start, return once every container is healthy",
        description="Run again with other --scale values to resize the pools.",
    )
    up.add_argument("--port", type=int, default=8000, help="the gateway's host port (8000)")
    up.add_argument(
        "--scale",
        action="append",
        default=[],
        metavar="SERVICE=N",
        help="instances of a service (repeatable), e.g. --scale drafter=3 --scale decode=2",
    )
    down = sub.add_parser("down", help="remove the containers, volumes and networks")
    down.add_argument("--images", action="store_true", help="remove our images too")
    compose = sub.add_parser("compose", help="a compose command on this deployment")
    compose.add_argument("args", nargs=argparse.REMAINDER, help="e.g. ps, logs decode")
    return parser


def main() -> None:
    args = _parser().parse_args()
    try:
        if args.command == "up":
            if not 0 < args.port < 65536:
                raise ValueError(f"--port {args.port} is not a TCP port")
            stack.up(args.port, args.scale)
        elif args.command == "down":
            stack.down(args.images)
        else:
            sys.exit(stack.passthrough(args.args))
    except (DockerError, RuntimeError, TimeoutError, ValueError) as exc:
        print(f"scripts/compose-local: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
