"""The structure rules of docs/architecture.md, checked on the source tree.

- packages depend one way: data_tools → pretrain → model_providers (no package imports one that imports it back);
- no import cycle between files (lazy imports inside functions count too);
- no source file over 500 lines, no function over 150 lines;
- no model-family name (family, HF architecture or model_type) outside model_providers/ (a line may say why a
  literal that happens to equal one is not about a model family: `# family-name-ok: <reason>`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model_providers", "pretrain", "data_tools")
# Each package may import only the packages listed after it.
LAYERS = {"data_tools": {"pretrain", "model_providers"}, "pretrain": {"model_providers"}, "model_providers": set()}
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 150


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str) -> set[str]:
    """Project modules `name` imports anywhere in its body (resolved to the longest existing module)."""
    found = set()
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(TREES[name]):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def test_packages_depend_one_way():
    wrong = sorted(f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps
                   if a.split(".")[0] != b.split(".")[0] and b.split(".")[0] not in LAYERS[a.split(".")[0]])
    assert not wrong, "\n".join(wrong)


def _parent_package(name: str) -> str | None:
    return name.rpartition(".")[0] or None


def _cycles(nodes, deps) -> list[list[str]]:
    """The cycles a depth-first walk of `deps` (node -> the nodes it imports) meets, each as a path."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(deps(node)):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in sorted(nodes):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_import_cycle_between_files():
    # A package's __init__ importing its own submodules is how packages expose names, not a cycle.
    def deps(name: str) -> set[str]:
        return {d for d in GRAPH[name] if not (d == _parent_package(name) and MODULES[d].name == "__init__.py")}

    cycles = _cycles(MODULES, deps)
    assert not cycles, "\n".join(" → ".join(c) for c in cycles)


def test_files_and_functions_stay_short():
    long_files = [f"{p.relative_to(ROOT)}: {n} lines" for p in MODULES.values()
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    long_functions = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long_files and not long_functions, "\n".join(long_files + long_functions)


def _family_names() -> set[str]:
    from model_providers import FAMILIES

    names = set()
    for family in FAMILIES.values():
        names |= {family.name, family.hf_architecture, family.hf_model_type}
    return names


@pytest.mark.parametrize("package", ["pretrain", "data_tools"])
def test_no_family_name_outside_model_providers(package):
    names = _family_names()
    hits = []
    for name, tree in TREES.items():
        if not name.startswith(package):
            continue
        lines = MODULES[name].read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if any("# family-name-ok:" in ln for ln in lines[node.lineno - 1: node.end_lineno]):
                    continue
                words = set(node.value.replace("'", " ").replace('"', " ").split())
                if node.value in names or words & names:
                    hits.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not hits, "\n".join(hits)


MAX_TOP_LEVEL_MODULES = 15  # pretrain/ grows by sub-packages grouped by concern, not by top-level files


def test_pretrain_top_level_stays_small():
    top = sorted(p.name for p in (ROOT / "pretrain").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at the top of pretrain/: {top}"


def _folder(name: str) -> str:
    """The unit of the folder-level graph: pretrain's sub-package (or top-level module) a module belongs to."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "pretrain" and len(parts) > 1 else parts[0]


def test_no_loop_between_pretrain_folders():
    """pretrain's sub-packages and top-level modules depend one way: no loop among them (lazy imports count)."""
    edges: dict[str, set[str]] = {}
    for a, deps in GRAPH.items():
        if not a.startswith("pretrain."):
            continue
        for b in deps:
            if b.startswith("pretrain.") and _folder(a) != _folder(b):
                edges.setdefault(_folder(a), set()).add(_folder(b))
    loops = _cycles(edges, lambda node: edges.get(node, ()))
    assert not loops, "\n".join(" → ".join(c) for c in loops)
