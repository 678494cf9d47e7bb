"""The shape of the code: no module uses another's private names; files stay small."""

import ast
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "hetrain"


def _files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private(tree: ast.AST) -> set[str]:
    """Private names a file defines: functions, classes, module variables, attributes set on self."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _private(node.target.id):
            names.add(node.target.id)
    return names


def test_no_module_uses_another_modules_private_names():
    trees = {p: ast.parse(p.read_text(), str(p)) for p in _files()}
    defined = {p: _defined_private(t) for p, t in trees.items()}
    owners: dict[str, set[Path]] = {}
    for p, names in defined.items():
        for n in names:
            owners.setdefault(n, set()).add(p)
    found = []
    for p, tree in trees.items():
        outside = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names if not a.name.startswith("hetrain")}   # os, torch, ...: not ours
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetrain"):
                found += [f"{p.relative_to(ROOT.parent)}:{node.lineno} imports {a.name}"
                          for a in node.names if _private(a.name)]
            if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.ctx, ast.Load):
                base = node.value
                if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in outside):
                    continue
                if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                    continue
                others = owners.get(node.attr, set()) - {p}
                if others and node.attr not in defined[p]:
                    found.append(f"{p.relative_to(ROOT.parent)}:{node.lineno} uses .{node.attr} of "
                                 f"{', '.join(str(o.relative_to(ROOT.parent)) for o in sorted(others))}")
    assert not found, "\n".join(found)


def test_files_stay_small():
    sizes = {p: len(p.read_text().splitlines()) for p in _files() if p.name != "__init__.py"}
    over = {str(p.relative_to(ROOT.parent)): n for p, n in sizes.items() if n > 500}
    assert not over, f"files over 500 lines: {over}"
    assert statistics.median(sizes.values()) < 250
