"""What every notebook's first line runs after labkit is importable: `import labkit.start`.

The line itself (labkit/_notebook_meta.py writes it, tests/test_install.py checks every notebook) first
installs the workbook on Colab with pip when labkit is missing there; this module does the rest, once per
kernel, on import:

- on Colab, it says when a package this kernel had already imported was replaced on disk (pip upgraded it
  beside the running copy: Colab imports numpy and pandas before the first cell), names it with both
  versions, shows Colab's RESTART SESSION button and stops the run, since the rest of the notebook would
  mix two versions of one package; otherwise it turns on Colab's custom widget manager, which ipywidgets 8
  (the explorers) needs there, and says that labkit is ready;
- elsewhere it does nothing and prints nothing, so the notebooks' stored first-cell outputs stay empty.

A kernel without labkit never reaches this module: the line's import then fails, and its comment, which
the traceback shows, says what to do (README, Install).
"""

from __future__ import annotations

import re
import sys
import warnings
from importlib import metadata

from labkit.errors import LabkitError

__all__ = ["RestartNeeded", "replaced_in_memory", "set_up"]

# Colab's own display type for "these packages were imported before pip replaced them": its front end
# draws the warning with a RESTART SESSION button (google/colab/_pip.py sends the same bundle).
_COLAB_DATA = "application/vnd.colab-display-data+json"


class RestartNeeded(LabkitError):
    """Packages this kernel had imported were replaced on disk: restart the kernel, then run the cell again."""

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines instead of a traceback
        return [str(self)]


def _release(version: str) -> tuple[int, ...] | None:
    """The numeric release of a version string (2.4.1, 2.13.0+cpu -> (2, 13, 0)); None when it has none."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", str(version).strip())
    if not match:
        return None
    numbers = [int(part) for part in match.group(1).split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:  # 2.4 and 2.4.0 are one release
        numbers.pop()
    return tuple(numbers)


def replaced_in_memory(modules: dict | None = None) -> dict[str, tuple[str, str]]:
    """{distribution: (version in memory, version on disk)} for each imported top-level package whose
    installed distribution now has another version than the one this process imported."""
    modules = sys.modules if modules is None else modules
    owners = metadata.packages_distributions()
    replaced = {}
    for name, module in list(modules.items()):
        with warnings.catch_warnings():  # some packages deprecate __version__ (jsonschema): it still answers
            warnings.simplefilter("ignore")
            in_memory = getattr(module, "__version__", None)
        if "." in name or not isinstance(in_memory, str) or _release(in_memory) is None:
            continue
        for distribution in owners.get(name, ()):
            try:
                on_disk = metadata.version(distribution)
            except metadata.PackageNotFoundError:  # removed since: nothing on disk to compare
                continue
            if _release(on_disk) != _release(in_memory) or _local(on_disk) != _local(in_memory):
                replaced[distribution] = (in_memory, on_disk)
    return replaced


def _local(version: str) -> str:
    return str(version).partition("+")[2]


def _on_colab() -> bool:
    return "google.colab" in sys.modules


def _enable_colab_widgets() -> None:
    from google.colab import output

    output.enable_custom_widget_manager()


def _show_colab_restart_button(distributions: list[str]) -> None:
    from IPython.display import display

    display({_COLAB_DATA: {"pip_warning": {"packages": distributions}}}, raw=True)


def set_up() -> None:
    """On Colab: stop where a restart is needed, else turn the widget manager on. Elsewhere: nothing."""
    if not _on_colab():
        return
    replaced = replaced_in_memory()
    if replaced:
        _show_colab_restart_button(sorted(replaced))
        changes = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in sorted(replaced.items()))
        raise RestartNeeded(f"Restart needed: pip replaced packages this runtime had already imported ({changes}). "
                            "Restart it (Runtime > Restart session), then run this cell again: labkit is installed "
                            "now, so it installs nothing twice.")
    _enable_colab_widgets()
    import labkit

    print(f"labkit {labkit.__version__} is ready (Colab's widget manager is on, for the explorers).")


set_up()
