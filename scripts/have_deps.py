"""Exit 0 when every dependency of qwire (pyproject.toml: the runtime ones and the ``dev`` extras that the
tests import) is installed at an accepted version, and setuptools can build qwire without the network;
else exit 1, naming what is missing (scripts/setup.sh then installs from the package index)."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

# torch: setup.sh handles it; ruff: a linter, not needed to run or test qwire; pytest-xdist: without it the tests
# run one at a time (tests/conftest.py)
SKIP = {"torch", "ruff", "pytest-xdist"}


def main() -> int:
    try:
        import tomllib  # Python 3.11+
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
    except ImportError:
        return 1
    data = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    project = data["project"]
    wanted = list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("dev", []))
    wanted += data["build-system"]["requires"]  # qwire is built here, not in a downloaded build environment
    env = default_environment()
    missing = []
    for line in wanted:
        req = Requirement(line)
        if req.name in SKIP or (req.marker is not None and not req.marker.evaluate(env)):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{req.name} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(f"{req.name} {have} (wants {req.specifier})")
    if missing:
        print("setup: not installed yet: " + ", ".join(missing))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
