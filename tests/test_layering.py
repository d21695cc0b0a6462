"""The package order of docs/architecture.md holds: no module imports from a package above its own.

Checked on the source (every `import`, including the lazy ones inside functions), so a cycle cannot hide behind a
deferred import. The root `hybridlm/__init__.py` is the public facade and may import anything; other modules may
take only `__version__` from it.
"""
import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "hybridlm"

# lowest first; a package may import from its own rank and below
LAYERS = [
    {"errors", "jsonio", "runtime", "dtypes", "plots", "optim", "markdown"},   # leaf utilities
    {"ops"},
    {"context", "cache"},
    {"layers"},
    {"models"},
    {"vllm"},                     # the vLLM plugin: models and below only; nothing imports it (below)
    {"data"},
    {"checkpoint"},
    {"eval"},
    {"train"},
    {"hf"},
    {"serve"},
    {"bench"},
    {"commands"},
    {"cli", "__main__"},
]
RANK = {name: i for i, group in enumerate(LAYERS) for name in group}


def _imports(path: pathlib.Path):
    """(line, imported hybridlm top-level name, names taken) for every import of a hybridlm module in `path`."""
    rel = path.relative_to(SRC).with_suffix("").parts        # ("train", "trainer") or ("cli",)
    package = rel[:-1] if rel[-1] != "__init__" else rel[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = list(base) + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "hybridlm" or node.module.startswith("hybridlm.")):
                target = node.module.split(".")[1:]
            else:
                continue
            yield node.lineno, (target[0] if target else None), (names if not target else [])
            if not target:                                    # `from .. import x`: x may be a package
                continue
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("hybridlm."):
                    yield node.lineno, a.name.split(".")[1], []


def _modules():
    return sorted(p for p in SRC.rglob("*.py") if p != SRC / "__init__.py")


def test_every_package_has_a_rank():
    tops = {p.relative_to(SRC).parts[0].removesuffix(".py") for p in _modules()}
    assert tops - RANK.keys() == set(), "a new package: give it its place in LAYERS and docs/architecture.md"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_go_down(path):
    own = path.relative_to(SRC).parts[0].removesuffix(".py")
    bad = []
    for line, target, names in _imports(path):
        if target is None:                                    # `from .. import name` of the root package
            bad += [f"line {line}: imports {n} from the hybridlm facade" for n in names
                    if n != "__version__" and n not in RANK]
            targets = [n for n in names if n in RANK]
        else:
            targets = [target]
        for t in targets:
            if t != own and RANK.get(t, -1) > RANK[own]:
                bad.append(f"line {line}: {own} imports {t}, a package above it")
    assert not bad, f"{path.relative_to(SRC)}: " + "; ".join(bad)


def test_nothing_imports_the_vllm_plugin():
    """hybridlm.vllm imports vLLM: only vLLM's plugin loader (the entry point) may import it."""
    bad = [f"{p.relative_to(SRC)}:{line}" for p in _modules() if p.relative_to(SRC).parts[0] != "vllm"
           for line, target, names in _imports(p) if target == "vllm" or (target is None and "vllm" in names)]
    assert not bad, "imports hybridlm.vllm: " + ", ".join(bad)


def _package(parts: tuple) -> str:
    """The package a module belongs to: ("bench", "gpu", "checks") -> "bench"; ("cli",) -> "cli"."""
    return parts[0].removesuffix(".py")


def _private_imports(path: pathlib.Path):
    """(line, module, name) for every `from hybridlm.X import _name` where X is another package than path's."""
    rel = path.relative_to(SRC).with_suffix("").parts
    package = rel[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            target = list(package[:len(package) - (node.level - 1)]) + (node.module.split(".") if node.module else [])
        elif node.module and node.module.startswith("hybridlm."):
            target = node.module.split(".")[1:]
        else:
            continue
        if target and target[0] != _package(rel):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    yield node.lineno, ".".join(target), a.name


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_private_name_crosses_a_package(path):
    """What another package imports is public: an underscore says "this package's own"."""
    bad = [f"line {line}: {name} from {module}" for line, module, name in _private_imports(path)]
    assert not bad, f"{path.relative_to(SRC)} imports private names of another package: " + "; ".join(bad)


def _private_definitions() -> dict[str, set[str]]:
    """Package -> the underscore names it defines: functions, classes, module globals, attributes it assigns
    (`self._x = ...`, class-level `_x = ...`)."""
    out: dict[str, set[str]] = {}
    for path in _modules():
        names = out.setdefault(_package(path.relative_to(SRC).parts), set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {p: {n for n in names if n.startswith("_") and not n.startswith("__")} for p, names in out.items()}


PRIVATE = _private_definitions()


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_private_attribute_crosses_a_package(path):
    """`x._name` where `_name` belongs to another package (a method or attribute only another package defines)
    reaches into that package's internals: it needs a public name there."""
    own = _package(path.relative_to(SRC).parts)
    theirs = set().union(*(names for p, names in PRIVATE.items() if p != own)) - PRIVATE.get(own, set())
    bad = [f"line {node.lineno}: .{node.attr}" for node in ast.walk(ast.parse(path.read_text()))
           if isinstance(node, ast.Attribute) and node.attr in theirs]
    assert not bad, f"{path.relative_to(SRC)} uses private attributes of another package: " + "; ".join(bad)
