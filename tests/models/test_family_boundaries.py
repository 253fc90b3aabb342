"""A model family lives in its folder: nothing else in the package names it.

Outside `src/moetext/models/<family>/`, no module imports a family package, and no code holds a
family's name (or a config.json model_type its HF adapter reads) as a string literal; the
exceptions are the registry line in `models/__init__.py` and the `model.family` default in
`config/schema.py`. Docstrings and comments may cite models. Everything else reaches a family
through `models.get_family(...)` / `models.family_for_hf(...)`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from moetext import models

SRC = Path(__file__).resolve().parents[2] / "src" / "moetext"
MODELS = SRC / "models"
SHARED = {"layers", "moe"}  # the building blocks every family uses
ALLOWED_IMPORTS = {MODELS / "__init__.py"}  # the registry line: one import per family
ALLOWED_LITERALS = {SRC / "config" / "schema.py"}  # the model.family default


def family_packages() -> set[str]:
    return {
        p.name
        for p in MODELS.iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name not in SHARED
    }


def family_names() -> set[str]:
    names = set(models.available_families())
    for name in models.available_families():
        hf = models.get_family(name).hf
        names |= set(hf.model_types) if hf else set()
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function, and the
    field docstrings that follow an assignment)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if (
                isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                out.add(id(stmt.value))
    return out


def _outside_families() -> list[Path]:
    inside = [MODELS / name for name in family_packages()]
    return [
        p
        for p in sorted(SRC.rglob("*.py"))
        if not any(p.is_relative_to(folder) for folder in inside)
    ]


def test_there_are_family_packages_and_names():
    assert "qwen3_moe" in family_packages()
    assert {"qwen3_moe", "dense", "qwen2_moe"} <= family_names()


def import_violations(paths: list[Path]) -> list[str]:
    packages = {f"moetext.models.{name}" for name in family_packages()}
    bad = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if any(target == p or target.startswith(p + ".") for p in packages):
                    bad.append(f"{path}:{node.lineno} imports {target}")
    return bad


def literal_violations(paths: list[Path]) -> list[str]:
    names = family_names()
    bad = []
    for path in paths:
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docs
                and node.value in names
            ):
                bad.append(f"{path}:{node.lineno} {node.value!r}")
    return bad


def test_no_module_outside_a_family_imports_it():
    bad = import_violations([p for p in _outside_families() if p not in ALLOWED_IMPORTS])
    assert not bad, "\n".join(bad)


def test_no_module_outside_a_family_names_one():
    bad = literal_violations([p for p in _outside_families() if p not in ALLOWED_LITERALS])
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""Cites qwen3_moe in a docstring: allowed."""\n'
        "from moetext.models import qwen3_moe\n"
        "import moetext.models.qwen3_moe.hf\n"
        'FAMILY = "qwen3_moe"  # not allowed\n'
        'KIND = "qwen2_moe"\n'
    )
    assert len(import_violations([bad])) == 2
    assert [v.split()[-1] for v in literal_violations([bad])] == ["'qwen3_moe'", "'qwen2_moe'"]
    good = tmp_path / "good.py"
    good.write_text('"""qwen3_moe"""\nfrom moetext import models\nx = models.get_family("x")\n')
    assert import_violations([good]) == literal_violations([good]) == []
