"""The pins are the course's reproducibility: pyproject, environment.yml and the lock must agree."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def pyproject_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"]["dev"]


def test_every_direct_dependency_is_pinned_exactly():
    loose = [p for p in pyproject_pins() if not re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", p)]
    assert not loose, f"pin these exactly with ==: {loose}"


def test_torch_is_the_course_version():
    assert "torch==2.13.0" in pyproject_pins()


def test_environment_yml_lists_the_same_pins():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    conda_pins = sorted(line for line in pip_section if "==" in line)
    assert conda_pins == sorted(pyproject_pins())
    assert "python=3.11" in env["dependencies"]


def normalise(name):
    """pip's spelling rule: PyYAML, pyyaml and py_yaml name one package."""
    return name.lower().replace("_", "-")


def test_lock_file_agrees_with_direct_pins():
    locked = dict(
        line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line
    )
    locked = {normalise(k): v for k, v in locked.items()}
    for pin in pyproject_pins():
        name, version = pin.split("==")
        assert locked.get(normalise(name)) == version, f"constraints.txt disagrees with pyproject on {name}"


def test_git_hooks_run_pinned_local_tools_and_download_nothing():
    # pre-commit fetches a hook repository or builds a hook environment for anything but a local,
    # system hook; those would bypass the pins and fail on a machine without network.
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert [repo["repo"] for repo in config["repos"]] == ["local"]
    assert {hook["language"] for hook in hooks} == {"system"}
    assert not [hook["id"] for hook in hooks if "additional_dependencies" in hook]
    pinned = {normalise(pin.split("==")[0]) for pin in pyproject_pins()}
    tools = {hook["entry"].split()[2] for hook in hooks if hook["entry"].startswith("python -m ")}
    assert tools - {"labkit"} <= pinned, f"hooks run tools that pyproject does not pin: {tools - pinned}"
