"""specmesh's shared code. Set here, before any of its modules loads torch: torch's OpenMP
threads sleep as soon as a parallel region ends. Spinning, they took the cores that the
CPU kernels' pool and the other services' threads were waiting for (a process that loaded
torch before importing specmesh keeps its own setting)."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
