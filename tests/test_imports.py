"""The package map of docs/architecture.md, enforced: which moetext package may import which.

Every `import moetext.X` / `from moetext.X import ...` in src/moetext (module level or inside a
function: a lazy import is still a dependency) is an edge between top-level packages/modules.
The edges must be allowed by LAYERS, and LAYERS itself must have no cycle, so no chain of
imports ever leads back to where it started.
"""

import ast
from collections.abc import Callable
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moetext"

# package -> what it may import. Lower layers know nothing of the ones above them.
LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "paths": {"errors"},  # user paths resolved and checked at the boundary (every CLI)
    # Reading compiled programs' HLO text: collectives, loops and their trip counts.
    "hlo": set(),
    # glibc malloc settings for the process, applied by the trainer's entry point.
    "host_memory": set(),
    # JAX's persistent compilation cache for the CLIs (where, per host CPU; hits counted).
    "compilation_cache": {"errors", "paths"},
    "config": {"errors", "paths"},
    "kernels": {"errors", "paths", "config"},
    "sharding": {"errors", "paths", "config"},
    "optim": {"errors", "paths", "config"},
    "data": {"errors", "paths", "config"},
    "checkpoint": {"errors", "paths", "config"},
    "models": {"errors", "paths", "config", "kernels", "sharding"},
    # What is compiled (model, plan, train/eval steps): shared by train, aot, generate.
    "program": {
        "errors",
        "paths",
        "config",
        "kernels",
        "sharding",
        "optim",
        "data",
        "models",
        "checkpoint",
    },
    "train": {
        "errors",
        "paths",
        "config",
        "kernels",
        "sharding",
        "optim",
        "data",
        "checkpoint",
        "models",
        "program",
        "compilation_cache",
    },
    # data: the compiled step takes the batch structure the data kind yields (batch_keys).
    "aot": {
        "errors",
        "paths",
        "config",
        "kernels",
        "sharding",
        "models",
        "optim",
        "data",
        "program",
        "hlo",
    },
    "hlo_cost": {"hlo"},  # FLOPs and HBM bytes of optimised HLO
    "step_cost": {"errors", "aot", "hlo_cost"},
    "convert": {"errors", "paths", "config", "models", "checkpoint"},
    "generate": {
        "errors",
        "paths",
        "config",
        "sharding",
        "models",
        "data",
        "checkpoint",
        "program",
        "compilation_cache",
    },
    "plot": {"errors", "paths"},
    "cli": {
        "errors",
        "paths",
        "config",
        "sharding",
        "checkpoint",
        "models",
        "train",
        "compilation_cache",
    },
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "moetext"


def imported(tree: ast.AST) -> list[str]:
    """Every module an import statement names, lazy ones included: `from a.b import c` names
    a.b and a.b.c (c may be a submodule)."""
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def edges_between(root: Path, part: Callable[[str], str | None]) -> dict[tuple[str, str], str]:
    """(importer, imported) parts, as `part` names a module (None: outside), of the files under
    root -> one file where it happens."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        here = part(".".join(rel.parts).removesuffix(".__init__"))
        for target in imported(ast.parse(path.read_text())):
            there = part(target)
            if here is not None and there is not None and there != here:
                edges.setdefault((here, there), str(path.relative_to(SRC.parent)))
    return edges


def import_edges() -> dict[tuple[str, str], str]:
    """(importer, imported) -> one file where it happens."""
    return edges_between(SRC, lambda m: _package(m) if m.startswith("moetext.") else None)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_every_package_is_in_the_map():
    packages = {p.stem if p.is_file() else p.name for p in SRC.iterdir()}
    packages = {p for p in packages if not p.startswith(("_", ".")) and p != "configs"}
    assert packages <= set(LAYERS), f"add {sorted(packages - set(LAYERS))} to LAYERS"


def test_the_map_has_no_cycle():
    assert _cycle(LAYERS) is None, _cycle(LAYERS)


def test_imports_follow_the_map():
    bad = [
        f"{a} imports {b} ({where})"
        for (a, b), where in sorted(import_edges().items())
        if a in LAYERS and b not in LAYERS[a]
    ]
    assert not bad, "\n".join(bad)


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# --- between the subpackages of moetext.kernels -------------------------------------------------

KERNELS_DIR = SRC / "kernels"

# kernels/<subpackage or module> -> what it may import of kernels ("__init__": kernels/__init__).
# pallas (kernel bodies, tilings) knows nothing of gmm (backends, the Gmm op, the Recipe protocol)
# or quant (recipes, FP8 numerics); gmm runs pallas kernels; quant wraps gmm backends and pairs
# them with the FP8 Pallas kernels. typed_jax and fp8_scaling are leaves every room may use;
# host_dots (bf16 operands widened on a CPU without bf16 dots) asks pallas.target whether the
# code is compiled for a TPU.
KERNELS: dict[str, set[str]] = {
    "typed_jax": set(),
    "fp8_scaling": {"typed_jax"},
    "pallas": {"typed_jax", "fp8_scaling"},
    "gmm": {"typed_jax", "pallas", "host_dots"},  # blocked: the CPU's tile-dot form
    "quant": {"typed_jax", "fp8_scaling", "pallas", "gmm"},
    "activations": {"gmm"},
    "host_dots": {"pallas"},
    "build": {"gmm", "quant"},
    "__init__": {"build", "gmm", "quant"},
}


def _kernels_part(module: str) -> str | None:
    """'moetext.kernels.gmm.api' -> 'gmm'; 'moetext.kernels' -> '__init__'; None outside."""
    parts = module.split(".")
    if parts[:2] != ["moetext", "kernels"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def kernels_import_edges() -> dict[tuple[str, str], str]:
    """(importer, imported) between parts of moetext.kernels -> one file where it happens."""
    return edges_between(KERNELS_DIR, _kernels_part)


def test_every_kernels_part_is_in_the_map():
    parts = {p.stem if p.is_file() else p.name for p in KERNELS_DIR.iterdir()}
    parts = {p for p in parts if not p.startswith(".") and p != "__pycache__"}
    assert parts <= set(KERNELS), f"add {sorted(parts - set(KERNELS))} to KERNELS"


def test_the_kernels_map_has_no_cycle():
    assert _cycle(KERNELS) is None, _cycle(KERNELS)


def test_kernels_imports_follow_the_map():
    bad = [
        f"kernels/{a} imports kernels/{b} ({where})"
        for (a, b), where in sorted(kernels_import_edges().items())
        if b not in KERNELS.get(a, set())
    ]
    assert not bad, "\n".join(bad)


def test_no_import_inside_a_kernels_function():
    # A function-local import hides a dependency (often a cycle) from whoever reads the module
    # head; kernels/ keeps every import at module level.
    hidden = [
        f"{path.relative_to(SRC.parent)}:{node.lineno}"
        for path in sorted(KERNELS_DIR.rglob("*.py"))
        for func in ast.walk(ast.parse(path.read_text()))
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(func)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    assert not hidden, hidden
