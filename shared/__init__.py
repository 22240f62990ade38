"""specmesh's shared code. `kernels` is imported first: it sets OpenMP's wait policy, which
only takes effect before torch loads."""

import specmesh.kernels  # noqa: F401
