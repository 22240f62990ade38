"""specmesh: speculative-decoding LLM serving as disaggregated services.

Its subpackages are the repository's folders: `specmesh.services` (services/), `specmesh.shared`
(shared/) and `specmesh.kernels` (kernels/), mapped there by setup.py when installed, and
`specmesh.drafters` (drafters/: the drafters trained for the default model), which its own
distribution, specmesh-drafters, installs beside them.
"""

from pathlib import Path

# Run from a checkout that is not installed (its directory or PYTHONPATH first on the
# path, as in an image's build steps): the folders beside this one are the subpackages,
# drafters/ among them.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "setup.py").is_file():
    __path__.append(str(_checkout))
