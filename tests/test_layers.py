"""The package's layers run one way: commands -> trainer -> building blocks -> base (parallel, config, files).

A module may import modules of its own layer or a lower one, never a higher one, and the top-level units (a
package such as ``rollout`` or a single module such as ``accounting.py``) never import each other in a circle.
The test reads every import of the package, module level and inside functions, so a new upward or circular
dependency fails here, naming the file and the import."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import mcpo_megatron

PACKAGE = Path(mcpo_megatron.__file__).resolve().parent

# Top-level units of each layer, lowest first.
LAYERS = [
    ("base", {"__init__", "parallel", "config", "files", "model_files", "reaper", "helper_signals",
              "helper_processes"}),
    ("building blocks", {"algorithms", "data", "models", "rollout", "rewards", "tools", "evaluation", "report",
                         "accounting", "planner"}),
    ("trainer", {"trainer"}),
    ("commands", {"commands", "cli"}),
]
LAYER_OF = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import of ``path`` into the package, ``from X import y`` counted as
    ``X.y`` so that ``from mcpo_megatron import accounting`` names the module it brings in."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, m) for line, m in found if m.split(".")[0] == "mcpo_megatron"]


def _unit(module: str) -> str:
    """The top-level unit a module belongs to: ``mcpo_megatron.rollout.engines.interface`` -> ``rollout``; names of the
    package's ``__init__`` (``mcpo_megatron.__version__``) -> ``__init__``."""
    parts = module.split(".")
    if len(parts) > 1 and ((PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()):
        return parts[1]
    return "__init__"


def import_graph() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> ['file:line imports module', ...] across units."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _unit(_module_name(path))
        for line, module in _imported_modules(path):
            dst = _unit(module)
            if dst != src:
                edges[(src, dst)].append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    return edges


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py") or (p / "__init__.py").is_file()}
    assert units <= set(LAYER_OF), f"put these in a layer of LAYERS: {sorted(units - set(LAYER_OF))}"


def test_no_import_goes_up_a_layer():
    upward = [f"{where} ({LAYERS[LAYER_OF[src]][0]} -> {LAYERS[LAYER_OF[dst]][0]})"
              for (src, dst), wheres in import_graph().items() if LAYER_OF[dst] > LAYER_OF[src] for where in wheres]
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_circle_between_units():
    graph = defaultdict(set)
    for src, dst in import_graph():
        graph[src].add(dst)
    circles = []

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                circles.append(" -> ".join([*path, nxt]))
            elif nxt not in path and nxt > path[0]:  # each circle once, from its smallest unit
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    edges = import_graph()
    detail = [f"  {a} -> {b}: {edges[(a, b)][0]}" for c in circles for a, b in zip(c.split(" -> "), c.split(" -> ")[1:])]
    assert not circles, "import circles between units:\n" + "\n".join(circles) + "\n" + "\n".join(detail)


def test_only_the_cli_runs_as_a_script():
    scripts = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                     if "__name__ == \"__main__\"" in p.read_text() or "__name__ == '__main__'" in p.read_text())
    assert scripts == ["mcpo_megatron/cli.py", "mcpo_megatron/reaper.py"], scripts


# rollout/'s sub-packages, lowest first: each imports only those before it (docs/decisions.md, "rollout/ by
# concern"). ``__init__`` is rollout/__init__.py (a docstring only).
ROLLOUT_ORDER = ["__init__", "weights", "engines", "episodes", "partial", "placement", "separate"]


def _rollout_room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["mcpo_megatron", "rollout"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in ROLLOUT_ORDER else "__init__"


def _package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported_package_module(module: str, modules: dict[str, Path]) -> str | None:
    """The package module an import names: ``X.y`` is module ``X.y`` when that exists, else module ``X``."""
    while module and module not in modules:
        module = module.rpartition(".")[0]
    return module or None


def test_rollout_sub_packages_import_one_way():
    modules = _package_modules()
    assert {_rollout_room(m) for m in modules if _rollout_room(m)} == set(ROLLOUT_ORDER), \
        "put every rollout/ sub-package in ROLLOUT_ORDER"
    upward = []
    for name, path in modules.items():
        src = _rollout_room(name)
        if src is None:
            continue
        for line, imported in _imported_modules(path):
            dst = _rollout_room(imported)
            if dst is not None and ROLLOUT_ORDER.index(dst) > ROLLOUT_ORDER.index(src):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported} ({src} -> {dst})")
    assert not upward, "rollout/ imports against its order " + " < ".join(ROLLOUT_ORDER) + ":\n" + "\n".join(upward)


def test_no_two_modules_import_each_other():
    modules = _package_modules()
    imports: dict[str, dict[str, int]] = defaultdict(dict)
    for name, path in modules.items():
        for line, imported in _imported_modules(path):
            target = _imported_package_module(imported, modules)
            if target is not None and target != name and not name.startswith(target + "."):
                imports[name].setdefault(target, line)
    circles = [f"{modules[a].relative_to(PACKAGE.parent)}:{imports[a][b]} <-> "
               f"{modules[b].relative_to(PACKAGE.parent)}:{imports[b][a]}"
               for a in sorted(imports) for b in sorted(imports[a]) if a < b and a in imports.get(b, {})]
    assert not circles, ("modules that import each other (move the piece both use into a module of its own):\n"
                         + "\n".join(circles))
