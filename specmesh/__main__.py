"""`python -m specmesh` is the `specmesh` command."""

from specmesh.services.cli import main

main()
