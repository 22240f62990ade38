"""python -m specmesh.kernels.check [--small]: exit status 1 when any kernel differs from its
reference."""

from __future__ import annotations

import argparse
import sys

from specmesh.kernels.check.result import table
from specmesh.kernels.check.suite import device, run


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m specmesh.kernels.check", description=__doc__)
    parser.add_argument("--small", action="store_true", help="the interpreter's shapes on a GPU")
    args = parser.parse_args()
    print(f"device: {device()}")
    results = run(small=True if args.small else None)
    print(table(results))
    sys.exit(0 if all(r.passed for r in results) else 1)


main()
