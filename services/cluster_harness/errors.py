"""What the harness reports to its user as a message, never as a traceback."""


class ClusterError(Exception):
    """An expected failure (bad input, no privileges, a host that did not start)."""
