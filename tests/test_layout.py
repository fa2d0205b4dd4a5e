"""The layout's rules, read from the source (imports inside functions count): no import
cycle among the project's modules; `models/` ships without the glue (torch, `kernels/` and
itself only, so a Hugging Face export can carry it); the FLOP primitives know no model."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("torchtitan_ext", "models", "kernels", "train_configs")


def module_files(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module of PACKAGES under root."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name an import statement anywhere in the file (functions included) names,
    relative imports resolved against `name`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """{module: project modules it imports}, each imported name cut back to the longest
    project module it names (`from a.b import c` is a.b, or a.b.c where c is a module)."""
    modules = module_files(root)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target in imported_names(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle [a, b, ..., a] of the graph, or None (depth-first search)."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def top_level_imports(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_names("", path) if name}


def test_no_import_cycle_counting_imports_inside_functions():
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    assert find_cycle(import_graph(REPO)) is None, " -> ".join(find_cycle(import_graph(REPO)))


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "a.py").write_text("from models.b import f\n")
    (tmp_path / "models" / "b.py").write_text("def f():\n    from models import a\n    return a\n")
    (tmp_path / "models" / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path)
    assert graph["models.c"] == {"models", "models.a"}
    assert find_cycle(graph) in (["models.a", "models.b", "models.a"], ["models.b", "models.a", "models.b"])
    (tmp_path / "models" / "b.py").write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_models_import_only_torch_kernels_and_themselves():
    allowed = {"torch", "kernels", "models", "__future__"} | set(sys.stdlib_module_names)
    outside = {str(path.relative_to(REPO)): sorted(top_level_imports(path) - allowed)
               for name, path in module_files(REPO).items() if name.split(".")[0] in ("models", "kernels")}
    # kernels/triton_kernels.py is the one module that needs triton (imported only where it exists).
    outside = {path: names for path, names in outside.items() if names and names != ["triton"]}
    assert not outside, outside


def test_the_flop_primitives_import_no_model():
    names = imported_names("torchtitan_ext.flops", REPO / "torchtitan_ext" / "flops.py")
    assert not [n for n in names if n.split(".")[0] in ("models", "torchtitan_ext", "train_configs")], names


def test_scripts_import_no_other_script_and_are_on_no_import_path():
    """scripts/ holds command lines only: none imports another (library code lives in the
    packages), and pytest puts scripts/ on no path (tests load a script by its file)."""
    import tomllib

    stems = {path.stem for path in (REPO / "scripts").glob("*.py")}
    crossing = {path.name: sorted(stems & {name.removeprefix("scripts.").split(".")[0]
                                           for name in imported_names("", path)})
                for path in sorted((REPO / "scripts").glob("*.py"))}
    assert not {name: found for name, found in crossing.items() if found}, crossing
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "scripts" not in str(options.get("pythonpath", "")), options["pythonpath"]


def test_models_layers_and_memories_import_downward_only():
    """models/layers/ imports nothing else from models/; models/memory/ only models/layers/,
    itself and kernels/ (a memory knows no graft, LM or backbone)."""
    graph = import_graph(REPO)
    upward = {module: sorted(target for target in targets if target.startswith("models")
                             and not target.startswith(allowed))
              for package, allowed in (("models.layers", ("models.layers",)),
                                       ("models.memory", ("models.layers", "models.memory")))
              for module, targets in graph.items() if module.startswith(package)}
    assert not {module: targets for module, targets in upward.items() if targets}, upward


def test_only_grafts_and_backbones_import_grafts():
    """A graft is what a backbone holds: no model under models/ other than grafts/ and
    backbones/ imports models/grafts/."""
    graph = import_graph(REPO)
    reaching = {module: sorted(t for t in targets if t.startswith("models.grafts"))
                for module, targets in graph.items()
                if module.startswith("models") and not module.startswith(("models.grafts", "models.backbones"))}
    assert not {module: found for module, found in reaching.items() if found}, reaching
