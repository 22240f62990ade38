"""scripts/cluster's command line (`python -m specmesh.services.cluster_harness`)."""

from __future__ import annotations

import argparse

from specmesh.services.cluster_harness import commands, netns
from specmesh.services.cluster_harness.errors import ClusterError
from specmesh.services.cluster_harness.topology import all_hosts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/cluster",
        description="specmesh on many hosts of one machine: Linux network namespaces on a "
        "bridge, a 3-node NATS cluster, valkey, one host per service instance.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up",
        help="create the hosts and start everything; returns once the gateway serves",
        description="Services also take every other option as a SPECMESH_* variable set "
        "for this command (e.g. SPECMESH_KV_CACHE_GB=0.25), as in docker-compose.yml.",
    )
    up.add_argument("--port", type=int, help="the gateway also at http://127.0.0.1:PORT")
    up.add_argument(
        "--delay-ms", type=float, help="delay every packet a host sends (tc netem), in ms"
    )
    up.add_argument(
        "--rate-mbit", type=float, help="limit what every host sends (tc tbf), in megabits/s"
    )
    up.add_argument("--model", help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    up.add_argument("--speculative-algorithm", default="NGRAM", help="(default: NGRAM)")
    up.add_argument(
        "--kv-transport",
        choices=("redis", "direct"),
        default="direct",
        help="K/V from prefill to decode through the valkey host, or pulled by decode from "
        "the prefill host (default: direct)",
    )
    sub.add_parser("hosts", help="the hosts, their addresses, what runs where")
    names = ", ".join(h.name for h in all_hosts())
    for name, help in (
        ("kill", "SIGKILL a host's process"),
        ("start", "start a killed host's process again"),
        ("partition", "cut a host's link to the bridge"),
        ("heal", "restore a partitioned host's link"),
    ):
        sub.add_parser(name, help=help).add_argument("host", help=names)
    sub.add_parser("down", help="remove every host, link, process and the state")
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    try:
        netns.check_root()  # every subcommand changes the network or reads root's state
        if args.command == "up":
            if args.port is not None and not 0 < args.port < 65536:
                raise ClusterError(f"--port {args.port} is not a TCP port")
            for name in ("delay_ms", "rate_mbit"):
                if (getattr(args, name) or 0) < 0:
                    raise ClusterError(f"--{name.replace('_', '-')} must be at least 0")
            if args.delay_ms and args.rate_mbit:  # each would be the link's one qdisc
                raise ClusterError("--delay-ms and --rate-mbit cannot be combined")
            shape = netns.LinkShape(args.delay_ms, args.rate_mbit)
            settings = commands.settings(args.model, args.speculative_algorithm, args.kv_transport)
            commands.up(args.port, shape, settings)
        elif args.command in ("hosts", "down"):
            getattr(commands, args.command)()
        else:
            getattr(commands, args.command)(args.host)
    # ValueError: an option the services' own configs refuse; RuntimeError: shared/infra.py
    # finding no nats-server or valkey-server
    except (ClusterError, ValueError, RuntimeError) as exc:
        parser.exit(2, f"scripts/cluster {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"scripts/cluster {args.command}: interrupted\n")


if __name__ == "__main__":
    main()
