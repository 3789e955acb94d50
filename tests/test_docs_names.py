"""Every name the docs and the README use (`mf.X.Y`, `meshfit.X.Y`, mkdocstrings' `::: path` lines) resolves.

A name is resolved as a user would reach it: `import meshfit`, then attribute by attribute, importing a
submodule where the attribute is one (`meshfit.runtime.cluster.initialize`).
"""

import glob
import importlib
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "docs", "api", "*.md")))
# A name not inside a path or a file name (`.meshfit.lock`, `kubectl apply -f meshfit.yaml`).
NAME = re.compile(r"(?<![\w./-])(?:mf|meshfit)(?:\.[A-Za-z_]\w*)+")
DIRECTIVE = re.compile(r"^:::\s*(\S+)", re.MULTILINE)
FILE_SUFFIXES = {"yaml", "yml", "json", "lock", "py", "md", "txt", "toml"}


def names_in(text: str) -> set[str]:
    """The package's dotted names in a Markdown text, `mf.` spelled out as `meshfit.`."""
    found = {re.sub(r"^mf\.", "meshfit.", name) for name in NAME.findall(text) + DIRECTIVE.findall(text)}
    return {name for name in found if name.rsplit(".", 1)[-1] not in FILE_SUFFIXES}


def resolves(name: str) -> bool:
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                return False
    return True


def documented_names() -> dict[str, list[str]]:
    """Each name -> the files that mention it."""
    where: dict[str, list[str]] = {}
    for path in DOCS + [os.path.join(ROOT, "README.md")]:
        for name in names_in(open(path).read()):
            where.setdefault(name, []).append(os.path.relpath(path, ROOT))
    return where


def test_names_are_found_in_prose_code_and_directives():
    text = (
        "`mf.callbacks.EarlyStopping(...)`, meshfit.runtime.cluster.initialize.\n"
        "::: meshfit.losses\n    options:\n"
        "holds `.meshfit.lock`; kubectl apply -f meshfit.yaml; src/meshfit.strategies\n"
    )
    assert names_in(text) == {"meshfit.callbacks.EarlyStopping", "meshfit.runtime.cluster.initialize", "meshfit.losses"}
    assert resolves("meshfit.runtime.cluster.initialize") and resolves("meshfit.strategies.MirroredStrategy")
    assert not resolves("meshfit.callbacks.EarlyStop") and not resolves("meshfit.no_such_module.x")


def test_every_name_the_docs_use_resolves():
    where = documented_names()
    assert len(where) > 100 and "meshfit.callbacks.MonitorCallback" in where  # the docs were read
    unresolved = {name: files for name, files in sorted(where.items()) if not resolves(name)}
    assert unresolved == {}, f"names the docs use that do not import: {unresolved}"
