"""The two install routes (pip/venv and conda) ask for the same packages."""
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # standard library from Python 3.11

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ \[;]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pyproject_packages() -> set:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = meta["dependencies"] + meta["optional-dependencies"]["dev"]
    return {_name(s) for s in specs}


def conda_packages() -> set:
    names = set()
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("dependencies:", 1)[1].splitlines():
        m = re.match(r"^\s*-\s+([A-Za-z][\w.-]*)", line)
        if m and not line.strip().startswith("- -e") and m.group(1) not in ("python", "pip"):
            names.add(CONDA_NAMES.get(m.group(1).lower(), m.group(1).lower()))
    return names


def test_environment_yml_lists_the_same_packages_as_pyproject():
    assert conda_packages() == pyproject_packages()


def test_environment_yml_installs_the_project_itself():
    assert '-e ".[dev]"' in (ROOT / "environment.yml").read_text()


def test_every_dependency_says_why_it_is_there():
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.findall(r'^\s*"([a-z][\w-]*)[^"]*",(.*)$', text, re.M)
    assert deps and all(comment.strip().startswith("#") for _, comment in deps), deps


def test_the_license_is_an_spdx_expression_the_build_backend_reads():
    # `license = { text = "MIT" }` makes setuptools print a deprecation box twice on every install;
    # the SPDX string (PEP 639) needs setuptools 77 or newer.
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "MIT"
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", []))  # PEP 639 forbids both
    setuptools = next(s for s in meta["build-system"]["requires"] if _name(s) == "setuptools")
    least = re.search(r">=\s*(\d+)", setuptools)
    assert least and int(least.group(1)) >= 77, setuptools
