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
    """torchtitan_ext/flops.py names the primitives of models/layers/flops.py (a layer, so it
    knows no model) and imports nothing else of the project."""
    targets = import_graph(REPO)["torchtitan_ext.flops"]
    assert targets <= {"models.layers.flops"}, targets


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


# (package, the models/ packages it may import): layers know nothing else of models/; a memory
# knows no graft, LM or backbone; only grafts and backbones hold grafts (`layering_violations`).
MODELS_RULES = (("models.layers", ("models.layers",)),
                ("models.memory", ("models.layers", "models.memory")))


def layering_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """{module: the models/ modules it imports against MODELS_RULES}; a module of models/
    outside grafts/ and backbones/ may not import grafts/."""
    found = {}
    for module, targets in graph.items():
        if not module.startswith("models"):
            continue
        allowed = next((a for package, a in MODELS_RULES if module.startswith(package)), None)
        bad = sorted(t for t in targets if t.startswith("models.") and (
            (allowed is not None and not t.startswith(allowed))
            or (t.startswith("models.grafts") and not module.startswith(("models.grafts", "models.backbones")))))
        if bad:
            found[module] = bad
    return found


def test_models_import_downward_only():
    """models/layers/ imports nothing else from models/; models/memory/ only models/layers/,
    itself and kernels/; only grafts/ and backbones/ import models/grafts/ (so Locas' and
    GradMem's memories are rows of the graft table without importing it)."""
    violations = layering_violations(import_graph(REPO))
    assert not violations, violations


def test_the_layering_check_sees_an_upward_import(tmp_path):
    """A memory importing the graft table, a layer importing a memory and an LM importing a
    graft are each reported; the same files importing downward are not."""
    files = {"models/layers/ffn.py": "from models.memory.locas import attach_locas\n",
             "models/memory/locas.py": "from models.grafts.graft import GRAFT_KINDS\n",
             "models/lms/mlp_lm.py": "from models.grafts.lora import LoRAConfig\n",
             "models/grafts/graft.py": "from models.memory import locas\n",
             "models/grafts/lora.py": "", "models/backbones/decoder_lm.py": "from models.grafts import graft\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for package in ("models", "models/layers", "models/memory", "models/lms", "models/grafts", "models/backbones"):
        (tmp_path / package / "__init__.py").write_text("")
    assert layering_violations(import_graph(tmp_path)) == {"models.layers.ffn": ["models.memory.locas"],
                                                          "models.memory.locas": ["models.grafts.graft"],
                                                          "models.lms.mlp_lm": ["models.grafts.lora"]}
    (tmp_path / "models/memory/locas.py").write_text("from models.layers import ffn\n")
    (tmp_path / "models/layers/ffn.py").write_text("import torch\n")
    (tmp_path / "models/lms/mlp_lm.py").write_text("from models.memory.locas import attach_locas\n")
    assert layering_violations(import_graph(tmp_path)) == {}


def test_importing_the_models_does_not_import_the_compiler():
    """An eager user of the models (an evaluation, a conversion, a Hugging Face export) pays
    for torch, not for dynamo's ~3.5 s import: kernels/ imports it where it compiles."""
    import subprocess

    code = ("import sys, models.lms.titans, models.lms.mela, models.grafts.memory_llama, kernels.whole_sequence; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
