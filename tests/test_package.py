"""The package's shape: no import cycles, `import meshfit` stays free of the parameter-server code, and only
`model.py` touches a `Model`'s private attributes."""

import ast
import os
import subprocess
import sys

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


def test_no_import_cycles_among_meshfit_modules():
    found = modules()
    graph = {name: imports(path, set(found), name) for name, path in found.items()}
    assert "meshfit.model" in graph["meshfit"] and "meshfit.saving" in graph["meshfit.model"]  # edges are seen
    assert cycles(graph) == []


def test_import_meshfit_loads_no_parameter_server_module():
    prefix = "meshfit.strategies.parameter_server"
    code = f"import sys, meshfit; print(sorted(m for m in sys.modules if m.startswith({prefix!r})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def private_model_accesses(path: str) -> list[str]:
    """`model._x` and `self.model._x` (read or written) in a file, as `line: expression`."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        if name in ("model", "_model"):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_model_py_touches_private_attributes_of_a_model():
    found = {name: private_model_accesses(path) for name, path in modules().items() if name != "meshfit.model"}
    assert {name: hits for name, hits in found.items() if hits} == {}
