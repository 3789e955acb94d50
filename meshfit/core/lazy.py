"""Names a package loads on first use (PEP 562), as if it had imported them all.

`meshfit` and `meshfit.strategies` use it: `meshfit launch` reads a strategy's
launcher module without importing JAX, and `import meshfit` costs nothing
until a name is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_names(
    package: str, names: Mapping[str, str], public: Iterable[str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`: each of `names` (name -> the module that defines it) is
    imported on first use and kept in `namespace` (the package's globals); any other name of `public`
    is a submodule. Internal modules are not attributes of the package until imported by name."""
    public = frozenset(public)

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value
            return value
        if name in public:  # a public submodule, as if the package had imported it
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as error:
                if error.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *public})

    return __getattr__, __dir__
