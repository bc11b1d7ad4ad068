"""The distribution's name cannot be confused with another project's: "labkit" on PyPI is an unrelated 2015
project (and "gradientlab" another), so no doc, notebook, README or install file may tell anyone to
`pip install labkit`, in any spelling; every install command names `gradient-lab-workbook` or a path."""

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Names on PyPI that belong to other projects; PyPI also refuses a new name that equals a taken one once
# separators and case are dropped, so that is the comparison.
TAKEN = ("labkit", "gradientlab")
IMPORT_PACKAGE = "labkit"
# A `pip install` (also `python -m pip`, `%pip`, `uv pip`, `pip3`) and its arguments up to the line's, the
# inline code's or the statement's end (a `;`, as after the notebooks' first-line install).
PIP_INSTALL = re.compile(r"\bpip3?\s+install\b(?P<arguments>[^\n`;]*)", re.IGNORECASE)
# A requirement string written out of a pip command: "labkit[lab] @ git+...", 'lab-kit>=0.1'.
REQUIREMENT_STRING = re.compile(r"""["'](?P<name>[A-Za-z][\w.-]*)\s*(\[[^\]]*\])?\s*(@|[<>=!~]=)[^"'\n]*["']""")
OPTIONS_WITH_A_VALUE = {"-c", "--constraint", "-r", "--requirement", "--index-url", "-i", "--extra-index-url",
                        "--find-links", "-f", "--python", "--target", "-t", "--prefix"}
TEXT_SUFFIXES = {".md", ".py", ".ipynb", ".yml", ".yaml", ".txt", ".toml", ".cfg", ".json", ".sh"}
TEXT_NAMES = {"Makefile", "postBuild", "run", "hook-python", "gpu-runner"}


def squashed(name):
    return re.sub(r"[-_.]+", "", name.lower())


def requirement_names(arguments):
    """The project names an install command's arguments ask for (paths, URLs and options left out)."""
    tokens = [token.strip("\"'") for token in re.findall(r'"[^"]*"|\'[^\']*\'|\S+', arguments)]
    names, skip_next = [], False
    for token in tokens:
        if skip_next or not token:
            skip_next = False
            continue
        if token.startswith("-"):
            skip_next = token in OPTIONS_WITH_A_VALUE
            continue
        if token[0] in "./~$<{" or "://" in token.split("@")[0]:
            continue  # a path, a variable or a URL, not a name on an index
        try:
            names.append(Requirement(token).name)
        except InvalidRequirement:
            continue
    return names


def forbidden_installs(text):
    """Every install of a name that, on PyPI, is another project's: (the name, the command or string)."""
    found = []
    for command in PIP_INSTALL.finditer(text):
        found += [(name, command.group(0)) for name in requirement_names(command.group("arguments"))
                  if squashed(name) in TAKEN]
    for written in REQUIREMENT_STRING.finditer(text):
        if squashed(written.group("name")) in TAKEN:
            found.append((written.group("name"), written.group(0)))
    return found


def text_of(path):
    if path.suffix == ".ipynb":  # the cells' text, not JSON's escaped quotes
        return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])
    return path.read_text(errors="replace")


def repository_files():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    paths = [ROOT / line for line in listed.stdout.splitlines()] if listed.returncode == 0 else list(ROOT.rglob("*"))
    this_test = Path(__file__).resolve()
    return [path for path in paths if path.is_file() and path.resolve() != this_test
            and (path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES) and "node_modules" not in path.parts]


@pytest.mark.parametrize("spelling", [
    "pip install labkit", "pip install 'labkit[cluster]'", 'python -m pip install -U "LabKit[lab]"',
    "%pip install --quiet lab-kit", "uv pip install lab_kit==0.1", "pip3 install -c constraints.txt labkit",
    'subprocess.run([..., "pip", "install", LABKIT]); LABKIT = "labkit[lab] @ git+https://example.org/x"',
    "pip install gradientlab", "pip install torch labkit",
])
def test_the_check_catches_every_spelling_of_the_strangers_project(spelling):
    assert forbidden_installs(spelling), spelling


@pytest.mark.parametrize("allowed", [
    "pip install -e '.[dev]'", "pip install -c constraints.txt -e .", 'pip install "gradient-lab-workbook[lab] @ git+x"',
    "pip install ./dist/gradient_lab_workbook-0.1.0-py3-none-any.whl", "pip install torch==2.13.0",
    "import labkit", "python -m labkit claims",
    """get_ipython().system("pip install 'gradient-lab-workbook[colab] @ git+x'"); import labkit.start""",
])
def test_the_check_lets_paths_and_the_projects_own_name_pass(allowed):
    assert forbidden_installs(allowed) == []


def test_the_distribution_name_is_free_and_the_import_package_stays_labkit():
    assert squashed(PROJECT["name"]) not in TAKEN
    assert PROJECT["scripts"]["labkit"].startswith(f"{IMPORT_PACKAGE}.")
    # pyproject's extras that pull in other extras name the project itself, never "labkit"
    for extra, requirements in PROJECT["optional-dependencies"].items():
        for line in requirements:
            assert squashed(Requirement(line).name) not in TAKEN, f"extra {extra!r}: {line}"


def test_no_doc_notebook_or_install_file_installs_the_strangers_labkit():
    offenders = [f"{path.relative_to(ROOT)}: {name!r} in {command.strip()!r}"
                 for path in repository_files() for name, command in forbidden_installs(text_of(path))]
    assert offenders == [], "install the workbook by its name, gradient-lab-workbook, or a path:\n" + "\n".join(offenders)
