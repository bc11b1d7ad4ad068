"""PEP 562 lazy attributes for labkit's packages: a name is imported from its module when first read.

`import labkit` and `import labkit.runner` then cost only what they import themselves, so a command
that needs no torch (`python -m labkit --help`, `claims`, `normalise`) never imports it, while
`labkit.GradTracer` or `from labkit import claims` imports what it names on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: str, homes: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, whose attribute NAME lives in module `homes[NAME]`.

    A home equal to ``f"{package}.{NAME}"`` is a submodule, imported as such; any other home is the
    module that defines NAME. Each attribute is cached in the package once read.
    """

    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(home)
        value = module if home == f"{package}.{name}" else getattr(module, name)
        package_globals = vars(importlib.import_module(package))
        package_globals[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(homes))

    return __getattr__, __dir__
