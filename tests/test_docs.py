"""README.md and every page of docs/ name only things that exist: files and folders, command-line flags, config
fields and other identifiers, read from their backticked spans; the README stays a front door that links every page.

A span is checked only when it looks like one of these as a whole (a path, `--flag`, `snake_case`, `A.b.c`);
Python expressions, shapes and layout strings are left alone.
"""
import argparse
import ast
import pathlib
import re
from functools import lru_cache

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "hybridlm"
DOC = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

SPAN = re.compile(r"`([^`\n]+)`")
OUTPUTS = {"runs", "OUT", "RUN"}                     # what a command writes: runs/bench/, OUT/step-000500/
WRITTEN = {"modeling_hybridlm.py"}                  # files hybridlm writes into run directories
PATH = re.compile(r"(?<![\w/.*-])([\w*-]+(?:/[\w*.-]+)*\.py)\b")      # layers/attention.py, errors.py, layers/*.py
FOLDER = re.compile(r"^([\w-]+(?:/[\w-]+)*)/$")                           # ops/triton/
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)")        # --on-nan
SNAKE = re.compile(r"^_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")                  # dsa_kl_weight, init_weights
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")                 # CausalLM.forward


def spans(text: str) -> list[str]:
    return SPAN.findall(text)


def missing_paths(text: str) -> list[str]:
    """Paths in backticks that are neither under the package nor under the repository root."""
    bad = []
    for span in spans(text):
        names = PATH.findall(span)
        m = FOLDER.match(span)
        if m:
            names.append(m.group(1))
        for name in names:
            if name.split("/")[0] in OUTPUTS or name in WRITTEN:
                continue
            if not any(list(base.glob(name)) for base in (SRC, ROOT)):
                bad.append(name)
    return bad


@lru_cache(maxsize=None)
def _parser_flags() -> frozenset:
    """Every option string of every `hybridlm` command (and sub-command)."""
    from hybridlm.cli import build_parser
    found, todo = set(), [build_parser()]
    while todo:
        p = todo.pop()
        for a in p._actions:
            found.update(a.option_strings)
            if isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    return frozenset(found)


@lru_cache(maxsize=None)
def _source() -> str:
    return "\n".join(p.read_text() for p in sorted(SRC.rglob("*.py")))


def missing_flags(text: str) -> list[str]:
    """Flags that no command's parser accepts. A flag written as a string literal in the source (an add_argument)
    is taken as is, so the parsers are built only when one is not."""
    bad = []
    for span in spans(text):
        for flag in FLAG.findall(span):
            if re.search(rf"[\"']{re.escape(flag)}[\"']", _source()):
                continue
            if flag not in _parser_flags():
                bad.append(flag)
    return bad


FILE_SUFFIXES = {"py", "json", "jsonl", "safetensors", "toml", "md", "txt", "yaml", "npy", "bin", "png", "csv"}


@lru_cache(maxsize=None)
def _index():
    """From the source, without importing it: (names defined anywhere: modules, classes, functions, arguments,
    assigned names and attributes; {module path: names it defines at top level}; {class: its members};
    ModelConfig and TrainConfig fields)."""
    names, modules, classes = set(), {}, {}
    for p in sorted(SRC.rglob("*.py")):
        parts = p.relative_to(SRC).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names.update(parts)
        tree = ast.parse(p.read_text())
        top = modules.setdefault(parts, set())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                top.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):   # lazy exports
                    top.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
            elif isinstance(node, ast.ImportFrom):
                top.update(a.asname or a.name for a in node.names)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):   # set or read: our fields, transformers' config fields
                names.add(node.attr)
            elif isinstance(node, ast.alias):       # imported anywhere: `mamba_chunk_scan_combined`
                names.add((node.asname or node.name).rsplit(".", 1)[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SNAKE.match(node.value):
                names.add(node.value)               # keys the code reads or writes: config.json fields, JSON rows
            if isinstance(node, ast.ClassDef):      # its methods, class attributes and `self.x = ...`
                members = classes.setdefault(node.name, set())
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        members.add(sub.name)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        members.add(sub.attr)
                    elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                        members.add(sub.id)
    for p in list(SRC.rglob("*.yaml")) + list(SRC.rglob("*.toml")):     # lm-eval task names, recipe keys
        names.update(w for w in re.findall(r"[a-z][a-z0-9_]*", p.read_text()) if SNAKE.match(w))
    config = _fields(SRC / "models" / "config.py", "ModelConfig")
    config |= _fields(SRC / "train" / "trainer.py", "TrainConfig")
    return frozenset(names), modules, classes, frozenset(config)


def _fields(path: pathlib.Path, cls: str) -> set:
    """The annotated field names of dataclass `cls` in `path`."""
    node = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _dotted_exists(parts: list[str]) -> bool | None:
    """Whether `a.b.c` names something of ours (None: not ours, e.g. `torch.compile`). The longest leading part that
    is one of our modules (`ops.loss`, `common`: any module whose path ends so) must define the next part (or, for a
    variable named like the module, some class of ours must have it as a member); a class (`CausalLM.forward`) must
    define its member."""
    _, modules, classes, _ = _index()
    parts = parts[1:] if parts[0] == "hybridlm" else parts
    for i in range(len(parts), 0, -1):
        found = [defs for path, defs in modules.items() if path[-i:] == tuple(parts[:i])]
        if found:
            rest = parts[i:]
            if not rest:
                return True
            if any(rest[0] in defs for defs in found):
                return len(rest) == 1 or rest[0] not in classes or rest[1] in classes[rest[0]]
            # `cache.seen`: a variable named like the module, holding an object of one of our classes
            return any(rest[0] in members for members in classes.values())
    if parts[0] in classes:
        return parts[1] in classes[parts[0]]
    return None


def missing_names(text: str) -> list[str]:
    """snake_case spans that are neither a ModelConfig / TrainConfig field nor a name the source defines, and
    dotted spans of ours (`CausalLM.forward`, `ops.loss.linear_cross_entropy`) that do not resolve."""
    names, _, _, config = _index()
    bad = []
    for span in spans(text):
        if SNAKE.match(span) and span not in config and span not in names:
            bad.append(span)
        elif DOTTED.match(span) and span.rsplit(".", 1)[1] not in FILE_SUFFIXES:     # config.json is a file name
            if _dotted_exists(span.split(".")) is False:
                bad.append(span)
    return bad


def test_the_page_stays_short():
    assert len(DOC.read_text().split()) <= 1300, "docs/architecture.md is one page: move details into docstrings"


def _page_id(p: pathlib.Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_named_paths_exist(page):
    assert missing_paths(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_named_flags_exist(page):
    assert missing_flags(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_named_fields_and_names_exist(page):
    assert missing_names(page.read_text()) == []


def test_readme_is_a_front_door():
    """At most 1,500 words, and every page of docs/ linked from it."""
    text = README.read_text()
    assert len(text.split()) <= 1500
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_paper_by_file_name(page):
    """Papers are cited by title (docs/references.md), never by a file name outside the repository."""
    text = page.read_text()
    assert not re.search(r"\d{3}_[0-9a-f]{16}", text) and "REFERENCES.md" not in text and "DESIGN.md" not in text


def test_layering_order_matches_the_test():
    """The numbered package list follows tests/test_layering.py's LAYERS, rank by rank."""
    import test_layering
    text = DOC.read_text()
    section = text.split("## Packages", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. (.*?)(?=^\d+\. |\Z)", section, re.M | re.S)
    assert len(items) == len(test_layering.LAYERS)
    for item, group in zip(items, test_layering.LAYERS):
        named = {m.removesuffix(".py").removesuffix("/") for m in re.findall(r"`([\w]+(?:\.py|/))`", item)}
        assert group <= named, (item, group)


@pytest.mark.parametrize("doc, finder, expected", [
    ("see `train/checkpoint.py`", missing_paths, ["train/checkpoint.py"]),
    ("see `layers/nothing/`", missing_paths, ["layers/nothing"]),
    ("see `layers/*.py`, `checkpoint/files.py` and `ops/triton/`", missing_paths, []),
    ("run with `--twins`", missing_flags, ["--twins"]),
    ("run `hybridlm train --on-nan skip --resume`", missing_flags, []),
    ("set `ssd_no_such_field`", missing_names, ["ssd_no_such_field"]),
    ("set `dsa_kl_weight`, `grad_accum`, call `init_weights`", missing_names, []),
    ("`CausalLM.no_such_method` and `common.pyplot`", missing_names, ["CausalLM.no_such_method", "common.pyplot"]),
    ("`CausalLM.forward`, `hybridlm.errors`, `ops.loss.linear_cross_entropy`, `plots.pyplot`, `cache.seen`",
     missing_names, []),
    ("`m(x, ctx=ctx, cache=cache)`, `[B, T]`, `(S*4 A S*5)*2`, `torch.compile`, `config.json`", missing_names, []),
])
def test_the_checks_catch_what_is_missing(doc, finder, expected):
    assert finder(doc) == expected


def test_every_environment_variable_is_on_its_page():
    """docs/environment.md lists every variable the package reads (os.environ[...], .get, getenv)."""
    read = set()
    for path in SRC.rglob("*.py"):
        read |= set(re.findall(r"(?:environ(?:\.get)?\(?\[?|getenv\()\s*[\"']([A-Z][A-Z0-9_]*)[\"']", path.read_text()))
    page = (ROOT / "docs" / "environment.md").read_text()
    assert read and sorted(v for v in read if f"`{v}`" not in page) == []
