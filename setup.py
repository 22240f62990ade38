"""The one import namespace: the repository's folders install as subpackages of `specmesh`
(pyproject.toml holds everything else)."""

from setuptools import find_packages, setup

FOLDERS = ("services", "shared", "kernels")  # each becomes specmesh.<folder>

setup(
    packages=["specmesh"]
    + [f"specmesh.{f}{'.' + p if p else ''}" for f in FOLDERS for p in ["", *find_packages(f)]],
    package_dir={"specmesh": "specmesh", **{f"specmesh.{f}": f for f in FOLDERS}},
)
