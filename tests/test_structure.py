"""The package's structure, read from its source with ``ast``: the layer order of the design (an import never
points up), no import cycle between modules, a line budget per module, no private name taken from another
subpackage. Imports inside functions and under ``TYPE_CHECKING`` count: a lazy import hides a cycle, it does
not remove it. The checker tests itself on a small package with one problem of each kind."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "batchpilot"
MAX_LINES = 400
ROOT = "__init__"  # the package's own __init__.py
# Lower = deeper. A module imports from its own layer or deeper ones. Keys: the first part of the module name.
LAYERS = {
    "_validation": 0, "_extras": 0, "_wrappers": 0, "_plotting": 0, "rng": 0, "logs": 0, "clipping": 0,
    "distributed": 1,
    "data": 2,
    "stats": 3,
    "controllers": 4,
    "lr": 5,
    "sim": 6, "rl": 6,
    "engine": 7, "measure": 7, "checkpoint": 7,
    "integrations": 8,
    "bench": 9, "cli": 9, "__main__": 9, ROOT: 9,
}


def modules_of(src: Path) -> dict[str, Path]:
    """``{dotted name under the package: file}``; a subpackage is named by its folder, the package by ``ROOT``."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts) or ROOT] = path
    return found


def _package_of(name: str, path: Path) -> list[str]:
    """The package a module's relative imports start from, as name parts (``[]``: the package itself)."""
    parts = [] if name == ROOT else name.split(".")
    return parts if path.name == "__init__.py" else parts[:-1]


def imports_of(name: str, path: Path, modules: dict[str, Path], package: str) -> Iterator[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every import of the package in one file; ``from m import
    x`` where ``m.x`` is a module counts as an import of ``m.x``."""

    def known(parts: list[str]) -> str:
        while parts and ".".join(parts) not in modules:
            parts = parts[:-1]  # an attribute path: the deepest module on it
        return ".".join(parts) or ROOT

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    yield known(alias.name.split(".")[1:]), [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name, path)
                base = base[: len(base) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == package or node.module.startswith(package + ".")):
                base = node.module.split(".")[1:]
            else:
                continue
            plain = []
            for alias in node.names:
                if ".".join([*base, alias.name]) in modules:
                    yield ".".join([*base, alias.name]), [alias.name], node.lineno
                else:
                    plain.append(alias.name)
            if plain:
                yield known(base), plain, node.lineno


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def structure_problems(src: Path, max_lines: int = MAX_LINES) -> list[str]:
    """Every breach of the four rules in the package at ``src``, one line each."""
    modules = modules_of(src)
    problems, graph = [], {}
    for name, path in modules.items():
        top = name.split(".")[0]
        where = path.relative_to(src.parent)
        if top not in LAYERS:
            problems.append(f"{where}: {top!r} has no layer; add it to LAYERS as in DESIGN.md")
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > max_lines:
            problems.append(f"{where}: {lines} lines (budget {max_lines})")
        for target, names, line in imports_of(name, path, modules, src.name):
            if target == name:
                continue
            graph.setdefault(name, set()).add(target)
            target_top = target.split(".")[0]
            if LAYERS.get(target_top, -1) > LAYERS.get(top, 99):
                problems.append(f"{where}:{line}: {name} (layer {LAYERS[top]}) imports {target} "
                                f"(layer {LAYERS[target_top]}) upward")
            if target_top != top:
                problems += [f"{where}:{line}: private name {n} taken from {target}" for n in names
                             if n.startswith("_") and not n.startswith("__")]
    problems += ["import cycle: " + " <-> ".join(cycle) for cycle in _cycles(graph)]
    return problems


def test_the_package_keeps_its_layers_has_no_cycles_and_small_modules():
    problems = structure_problems(SRC)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------- the checker itself
def _write(root: Path, files: dict[str, str]) -> Path:
    src = root / "fakepkg"
    for relative, text in files.items():
        path = src / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


CLEAN = {
    "__init__.py": "from .engine import Pilot\nfrom . import controllers\n",
    "logs.py": "def log():\n    pass\n",
    "distributed.py": "from . import logs\n",
    "data/__init__.py": "",
    "data/loader.py": "from .. import distributed as bpdist\nfrom ..logs import log\n",
    "lr/__init__.py": "from ._common import check_rule\n",
    "lr/_common.py": "def check_rule():\n    pass\n\n\ndef _helper():\n    pass\n",
    "controllers/__init__.py": "from .a import A\n",
    "controllers/a.py": "from ._util import _clamp\n\n\nclass A:\n    pass\n",
    "controllers/_util.py": "def _clamp():\n    pass\n",
    "engine/__init__.py": "from .pilot import Pilot\n",
    "engine/pilot.py": "import fakepkg.lr\nfrom ..lr._common import check_rule\nfrom ..controllers import A\n\n\nclass Pilot:\n"
                       "    pass\n",
}


def test_the_checker_passes_a_clean_package(tmp_path):
    assert structure_problems(_write(tmp_path, CLEAN)) == []


def test_the_checker_finds_one_problem_of_each_kind(tmp_path):
    src = _write(tmp_path, {
        **CLEAN,
        "data/loader.py": CLEAN["data/loader.py"] + "\n\ndef lazy():\n    from ..engine.pilot import Pilot\n",
        "engine/pilot.py": CLEAN["engine/pilot.py"] + "\n\nfrom ..lr._common import _helper\n",
        "controllers/_util.py": CLEAN["controllers/_util.py"] + "\n\ndef later():\n    from . import a\n",
        "logs.py": "x = 1\n" * (MAX_LINES + 1),
        "oddity.py": "",
    })
    assert sorted(structure_problems(src)) == sorted([
        "fakepkg/data/loader.py:6: data.loader (layer 2) imports engine.pilot (layer 7) upward",
        "fakepkg/engine/pilot.py:10: private name _helper taken from lr._common",
        f"fakepkg/logs.py: {MAX_LINES + 1} lines (budget {MAX_LINES})",
        "fakepkg/oddity.py: 'oddity' has no layer; add it to LAYERS as in DESIGN.md",
        "import cycle: controllers._util <-> controllers.a",
    ])


@pytest.mark.parametrize("line, imported", [
    ("from . import logs", [("logs", ["logs"])]),  # a module taken by name is an import of that module
    ("from .logs import log", [("logs", ["log"])]),
    ("from .engine.pilot import Pilot", [("engine.pilot", ["Pilot"])]),
    ("from .engine import pilot, Pilot", [("engine.pilot", ["pilot"]), ("engine", ["Pilot"])]),
    ("import fakepkg.engine.pilot", [("engine.pilot", [])]),
    ("from fakepkg import data", [("data", ["data"])]),
    ("from fakepkg.engine.pilot.Pilot import x", [("engine.pilot", ["x"])]),
    ("import os", []),
])
def test_the_checker_resolves_each_form_of_import(tmp_path, line, imported):
    src = _write(tmp_path, {**CLEAN, "cli.py": "def run():\n    " + line + "\n"})
    assert [(t, n) for t, n, _ in imports_of("cli", src / "cli.py", modules_of(src), "fakepkg")] == imported
