"""The floors of docs/design.md: no module imports one of a higher floor, deferred imports included."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hetrain"
FLOORS = {
    "vocabulary": 0, "errors": 0, "userfiles": 0, "malloc_cache": 0, "exiting": 0, "__init__": 0,
    "hardware": 1, "workload": 2, "planning": 3, "checkpoint": 4, "metrics": 4,
    "runtime": 5, "launch": 6, "bench": 7, "cli": 8, "__main__": 8,   # python -m hetrain: the cli's
}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def test_no_module_imports_a_higher_floor():
    wrong, seen = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        floor = path.relative_to(PACKAGE).with_suffix("").parts[0]
        assert floor in FLOORS, f"{path}: {floor} is on no floor of docs/design.md"
        seen.add(floor)
        for line, module in _imports(path):
            parts = module.split(".")
            if parts[0] != "hetrain" or len(parts) < 2 or path.name == "__init__.py" and floor == "__init__":
                continue
            if FLOORS.get(parts[1], 0) > FLOORS[floor]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {floor} imports {module}")
    assert not wrong, "\n".join(wrong)
    assert {"runtime", "metrics", "planning", "cli"} <= seen
