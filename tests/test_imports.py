"""The package map of docs/architecture.md, enforced: which moetext package may import which.

Every `import moetext.X` / `from moetext.X import ...` in src/moetext (module level or inside a
function: a lazy import is still a dependency) is an edge between top-level packages/modules.
The edges must be allowed by LAYERS, and LAYERS itself must have no cycle, so no chain of
imports ever leads back to where it started.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moetext"

# package -> what it may import. Lower layers know nothing of the ones above them.
LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "kernels": {"errors", "config"},
    "sharding": {"errors", "config"},
    "optim": {"errors", "config"},
    "data": {"errors", "config"},
    "checkpoint": {"errors", "config"},
    "models": {"errors", "config", "kernels", "sharding"},
    "train": {
        "errors",
        "config",
        "kernels",
        "sharding",
        "optim",
        "data",
        "checkpoint",
        "models",
    },
    "aot": {"errors", "config", "kernels", "sharding", "models", "optim", "train"},
    "convert": {"errors", "config", "models", "checkpoint"},
    "generate": {"errors", "config", "sharding", "models", "data", "checkpoint", "train"},
    "plot": {"errors"},
    "cli": {"errors", "config", "sharding", "checkpoint", "models", "train"},
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "moetext"


def import_edges() -> dict[tuple[str, str], str]:
    """(importer, imported) -> one file where it happens."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        here = _package(".".join(rel.parts).removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "moetext":
                    targets = [f"moetext.{a.name}" for a in node.names]
                else:
                    targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("moetext."):
                    there = _package(target)
                    if there != here:
                        edges.setdefault((here, there), str(path.relative_to(SRC.parent)))
    return edges


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
