"""`scripts/cluster`: many hosts on one machine, for tests and fault drills across hosts.

Each host is a Linux network namespace with its own address on one bridge: a 3-node NATS
cluster, valkey (KV blocks cross hosts through it) and one host per service instance. The
hosts run the same servers and `python -m specmesh.services.<kind>` command lines, with the same
flags and SPECMESH_* variables, as docker-compose.yml or the Nomad jobs do; nothing in the
services knows about the harness.
"""
