"""The package's shape: no import cycles, `meshfit.Model` stays free of the parameter-server code, the
launcher free of JAX, and only `model.py` touches a `Model`'s private attributes."""

import ast
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "meshfit")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def modules() -> dict[str, str]:
    found = {}
    for root, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                found[module_name(os.path.join(root, name))] = os.path.join(root, name)
    return found


def imports(path: str, known: set[str], this: str) -> set[str]:
    """meshfit modules `path` imports, at module level or inside functions (not under TYPE_CHECKING)."""
    tree = ast.parse(open(path).read())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = this if path.endswith("__init__.py") else this.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return {name for name in found if name in known and name != this}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_no_import_cycles_among_meshfit_modules():
    found = modules()
    graph = {name: imports(path, set(found), name) for name, path in found.items()}
    assert (
        "meshfit.checkpointing.saving" in graph["meshfit.model"]
        and "meshfit.runtime.job_env" in graph["meshfit.launch.local"]
    )  # edges are seen
    assert cycles(graph) == []


def loaded_after(code: str, prefixes: tuple[str, ...]) -> list[str]:
    """Modules of the packages `prefixes` that a fresh interpreter has loaded after running `code`."""
    code += f"; import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {prefixes!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return eval(result.stdout)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.processes
def test_a_model_loads_no_parameter_server_module():
    loaded = loaded_after("import meshfit; meshfit.Model; meshfit.strategies.MirroredStrategy", ("meshfit", "ray"))
    assert "meshfit.model" in loaded  # the names did load
    assert [m for m in loaded if m.startswith("meshfit.strategies.parameter_server")] == []
    assert [m for m in loaded if m.split(".")[0] == "ray"] == []  # Ray is an optional extra


@pytest.mark.processes
def test_the_parameter_server_loads_ray_only_for_cluster_ray():
    code = "import meshfit; meshfit.strategies.ParameterServerStrategy(mode='sync')"
    assert loaded_after(code, ("ray",)) == []


@pytest.mark.processes
def test_the_launcher_imports_no_jax():
    """`meshfit launch` supervises processes and never computes: it starts in a fraction of a second."""
    assert loaded_after("import meshfit.cli", ("jax", "jaxlib", "flax", "optax", "orbax", "numpy", "ray")) == []


def test_names_load_on_first_use_as_if_imported():
    import meshfit

    assert {"Model", "load_model", "callbacks", "strategies", "__version__"} <= set(dir(meshfit))
    for name in meshfit.__all__:
        assert getattr(meshfit, name) is not None
    from meshfit.model import Model

    assert meshfit.Model is Model
    with pytest.raises(AttributeError, match="no attribute 'Modle'"):
        _ = meshfit.Modle


@pytest.mark.processes
def test_internal_modules_are_not_attributes_of_the_package():
    """`mf.<name>` is the public API only; internal modules are imported by their path."""
    code = "import meshfit as mf; print([n for n in ('feeder', 'session', 'checkpoint', 'launch') if hasattr(mf, n)])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]
    from meshfit.checkpointing.checkpoint import CheckpointDir

    assert CheckpointDir  # by its path


def test_every_module_the_package_exports_lists_its_public_names_and_each_resolves():
    """`meshfit.data`, `meshfit.outputs`, ...: `__all__` says what is API, not whatever they happen to import."""
    import meshfit

    exported = {name: getattr(meshfit, name) for name in meshfit.__all__}
    modules_ = {name: value for name, value in exported.items() if isinstance(value, types.ModuleType)}
    assert {"data", "outputs", "cluster", "strategies"} <= set(modules_)
    for name, module in modules_.items():
        assert isinstance(getattr(module, "__all__", None), list), f"meshfit.{name} defines no __all__"
        assert len(set(module.__all__)) == len(module.__all__), f"meshfit.{name}.__all__ repeats a name"
        missing = [public for public in module.__all__ if getattr(module, public, None) is None]
        assert missing == [], f"meshfit.{name}.__all__ names what it does not define: {missing}"


def private_accesses(path: str, owners: tuple[str, ...]) -> list[str]:
    """`<owner>._x` (read or written) in a file for each name in `owners`, as `line: expression`."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name in owners:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_model_py_touches_private_attributes_of_a_model():
    found = {
        name: private_accesses(path, ("model", "_model")) for name, path in modules().items() if name != "meshfit.model"
    }
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_model_py_stays_a_facade():
    """`meshfit.Model` is the Keras face: compile resolution, the first batch's build, data, callbacks, the
    training entry points (`training.trainer`, as Keras 3's `Trainer`), weights and the step methods live in
    the steps and training packages."""
    with open(os.path.join(ROOT, "model.py")) as file:
        lines = sum(1 for _ in file)
    assert lines <= 520, f"meshfit/model.py has {lines} lines; move logic to the steps or training packages."


SESSION_PARTS = ("session", "store", "cursor", "executables", "feeder", "context", "fit_context")


def test_no_test_or_callback_reads_a_private_attribute_of_the_session():
    """Tests and callbacks use the session's public seams (and callbacks only their `context`)."""
    tests = os.path.dirname(__file__)
    paths = [os.path.join(root, n) for root, _, names in os.walk(tests) for n in names if n.endswith(".py")]
    paths += [path for name, path in modules().items() if name.startswith("meshfit.callbacks")]
    found = {path: private_accesses(path, SESSION_PARTS) for path in paths if not path.endswith("test_package.py")}
    assert {path: hits for path, hits in found.items() if hits} == {}
    callbacks = [path for name, path in modules().items() if name.startswith("meshfit.callbacks")]
    assert [path for path in callbacks if ".session" in open(path).read()] == []


def private_reaches(path: str, this: str, known: set[str]) -> list[str]:
    """Where `path` (module `this`) takes another meshfit module's private name: `from meshfit.x import _y`
    or `x._y` on a module it imported (`from meshfit import x`, `import meshfit.x as x`), as `line: code`."""
    tree = ast.parse(open(path).read())
    package = this if path.endswith("__init__.py") else this.rsplit(".", 1)[0]
    modules_, found = {}, []  # local name -> the meshfit module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules_ |= {alias.asname: alias.name for alias in node.names if alias.asname and alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "meshfit":
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    modules_[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif alias.name.startswith("_") and not alias.name.startswith("__") and base != this:
                    found.append((node.lineno, node.col_offset, f"from {base} import {alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if modules_.get(owner, this) != this or (owner in known and owner != this):
                found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [f"{line}: {code}" for line, _, code in sorted(found)]


def test_no_module_takes_another_modules_private_names():
    """What two modules share is public (named without `_`, documented) in the module that owns it."""
    found = modules()
    reaches = {name: private_reaches(path, name, set(found)) for name, path in found.items()}
    assert {name: hits for name, hits in reaches.items() if hits} == {}


def test_private_reaches_are_seen(tmp_path):
    """The scan above sees each form of reach, and not a module's own private names."""
    path = tmp_path / "probe.py"
    path.write_text(
        "import meshfit.losses as L\nfrom meshfit import metrics\nfrom meshfit.launch.local import _Exits, free_port\n"
        "from .local import _stop\nfrom . import local\n"
        "L._float(1); metrics._NAMES; local._watch; meshfit.losses._float; _own(); probe._own\n"
    )
    known = set(modules()) | {"meshfit.launch.probe"}
    assert private_reaches(str(path), "meshfit.launch.probe", known) == [
        "3: from meshfit.launch.local import _Exits",
        "4: from meshfit.launch.local import _stop",
        "6: L._float",
        "6: metrics._NAMES",
        "6: local._watch",
        "6: meshfit.losses._float",
    ]


@pytest.mark.processes
def test_the_layers_contract_holds_and_sees_the_package():
    """pyproject.toml's [tool.importlinter] layers, checked by import-linter as `.ci/run` does."""
    result = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=os.path.dirname(os.path.abspath(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "meshfit's layers KEPT" in result.stdout


def test_the_top_of_the_package_is_its_public_face():
    """A dozen modules at the top (the public face); everything else in a package that names its layer."""
    flat = sorted(n[: -len(".py")] for n in os.listdir(ROOT) if n.endswith(".py") and n != "__init__.py")
    assert flat == [
        "cli",
        "cluster",
        "compilation_cache",
        "export",
        "losses",
        "metrics",
        "mixed_precision",
        "model",
        "outputs",
        "schedules",
        "utils",
    ]
