"""The service processes. Set before torch loads (every service imports this package first):
torch's OpenMP threads sleep as soon as a parallel region ends. Spinning, they took the
cores that the CPU kernels' pool and the other services' threads were waiting for."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
