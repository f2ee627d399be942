"""Optional imports of Megatron-Core's modules that a training process never uses, deferred to first use.

Importing megatron.core (and `megatron.core.tokenizers.text.libraries`, which every tokenizer goes through) pulls
in `wandb` (the dynamic inference context's and the timers' optional logging: ~4 s) and `transformers` (the
HuggingFace and chat-template tokenizers: ~3.5 s), although a run with a SentencePiece tokenizer and no W&B uses
neither. `first_import()` imports megatron.core with both hidden (each module's own `try: import ... except
ImportError` takes its fallback), then gives every such module back what it tried to import as a stand-in that
imports the real thing at first use, and its `HAVE_<NAME>` flag: afterwards the modules behave as if the import
had succeeded, and a run that does use HF tokenizers or W&B imports them then. Nothing is deferred that is not
installed, or that was already imported.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import sys

DEFERRED = ("transformers", "wandb")
FIRST_IMPORTS = ("megatron.core", "megatron.core.tokenizers.text.libraries")


class Deferred:
    """Stands for `module.attr` (or the module itself when `attr` is None), imported at first use."""

    def __init__(self, module: str, attr: str | None = None):
        self._where = (module, attr)

    def _target(self):
        module, attr = self._where
        loaded = importlib.import_module(module)
        return loaded if attr is None else getattr(loaded, attr)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(self._target(), name)

    def __call__(self, *args, **kwargs):
        return self._target()(*args, **kwargs)

    def __repr__(self) -> str:
        module, attr = self._where
        return f"<deferred {module}{'.' + attr if attr else ''}>"


def _optional_imports(module) -> list[tuple[str, str, str | None]]:
    """(name bound in `module`, module imported, attribute or None) for each import of a DEFERRED package inside a
    top-level `try:` of `module`'s source."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return []
    found = []
    for node in tree.body:
        if not isinstance(node, ast.Try):
            continue
        for stmt in ast.walk(ast.Module(body=node.body, type_ignores=[])):
            if isinstance(stmt, ast.Import):  # `import a.b` binds a; `import a.b as c` binds c to a.b
                found += [(a.asname, a.name, None) if a.asname else (a.name.split(".")[0], a.name.split(".")[0], None)
                          for a in stmt.names if a.name.split(".")[0] in DEFERRED]
            elif isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.module.split(".")[0] in DEFERRED:
                found += [(a.asname or a.name, stmt.module, a.name) for a in stmt.names]
    return found


@contextlib.contextmanager
def _hidden(names: list[str]):
    for name in names:
        sys.modules[name] = None  # `import name` raises ModuleNotFoundError
    try:
        yield
    finally:
        for name in names:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def first_import(window: contextlib.AbstractContextManager | None = None) -> list[str]:
    """Import megatron.core (inside `window`, e.g. torch.compile switched off) with DEFERRED hidden, then give the
    modules that tried to import them their stand-ins. Returns the packages deferred ([] if megatron.core was
    already imported)."""
    if "megatron.core" in sys.modules:
        return []
    hidden = [n for n in DEFERRED if n not in sys.modules and importlib.util.find_spec(n) is not None]
    with _hidden(hidden), (window or contextlib.nullcontext()):
        for name in FIRST_IMPORTS:
            importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or module is None:
            continue
        imports = [(bound, mod, attr) for bound, mod, attr in _optional_imports(module) if mod.split(".")[0] in hidden]
        for package in {mod.split(".")[0] for _, mod, _ in imports}:
            names = [(bound, mod, attr) for bound, mod, attr in imports if mod.split(".")[0] == package]
            if any(getattr(module, bound, None) is not None for bound, _, _ in names):
                continue  # a fallback of the module's own: leave it as it is
            for bound, mod, attr in names:
                setattr(module, bound, Deferred(mod, attr))
            flag = f"HAVE_{package.upper()}"
            if getattr(module, flag, None) is False:
                setattr(module, flag, True)
    return hidden
