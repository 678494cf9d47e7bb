"""pyproject.toml: every package hetrain imports is declared, the licence is an SPDX string with its
file, and the dashboard is package data."""

from __future__ import annotations

import ast
import re
import sys
from fnmatch import fnmatch
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
from packaging.requirements import Requirement  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# import name -> distribution, for optional packages that may not be installed here
NOT_INSTALLED = {"pynvml": "nvidia-ml-py"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(group: list[str]) -> dict[str, Requirement]:
    return {_norm(r.name): r for r in map(Requirement, group)}


def _imported_top_level() -> set[str]:
    names = set()
    for path in (ROOT / "hetrain").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "hetrain"}


def test_every_imported_package_is_declared():
    project = PROJECT["project"]
    declared = set(_declared(project["dependencies"]))
    for group in project["optional-dependencies"].values():
        declared |= set(_declared(group))
    dists = packages_distributions()
    undeclared = []
    for name in sorted(_imported_top_level()):
        owners = {_norm(d) for d in dists.get(name, [])} or {_norm(NOT_INSTALLED.get(name, name))}
        if not owners & declared:
            undeclared.append(f"{name} ({', '.join(sorted(owners))})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_packages_core_verbs_import_are_core_dependencies_installed_here():
    """`hetrain plan` fits its calibration with scipy; `hetrain bench data` decodes JPEGs with Pillow.
    Each lower bound admits the version installed here."""
    core = _declared(PROJECT["project"]["dependencies"])
    assert {"scipy", "pillow"} <= set(core)
    for name, req in core.items():
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue
        assert req.specifier.contains(installed, prereleases=True), (str(req), installed)


def test_licence_is_an_spdx_string_with_the_apache_text_shipped():
    project = PROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "9. Accepting Warranty or Additional Liability" in text
    # PEP 639 `license` strings and `license-files` arrived in setuptools 77
    [setuptools] = [Requirement(r) for r in PROJECT["build-system"]["requires"] if Requirement(r).name == "setuptools"]
    assert not setuptools.specifier.contains("76.1") and setuptools.specifier.contains("77.0.3")


def test_dashboard_is_package_data_and_is_what_the_package_reads():
    from hetrain.metrics.dashboard import OUT, shipped

    board = ROOT / "hetrain" / "data" / "dashboard.json"
    assert OUT == board and board.is_file()
    patterns = PROJECT["tool"]["setuptools"]["package-data"]["hetrain"]
    assert any(fnmatch("data/dashboard.json", p) for p in patterns), patterns
    assert shipped() == board.read_text()
    assert not (ROOT / "dashboards").exists(), "one copy of the dashboard: hetrain/data/dashboard.json"


def test_the_version_is_written_once_and_the_package_says_it_is_typed():
    """pyproject.toml reads the version from hetrain.__version__ (installed metadata and `hetrain
    --version` agree), and the typing marker is package data, so type checkers read hetrain's hints."""
    import hetrain

    assert "version" not in PROJECT["project"] and "version" in PROJECT["project"]["dynamic"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hetrain.__version__"}
    assert version("hetrain") == hetrain.__version__
    assert (ROOT / "hetrain" / "py.typed").is_file()
    assert "py.typed" in PROJECT["tool"]["setuptools"]["package-data"]["hetrain"]


def test_a_type_checker_sees_every_name_hetrain_exports_and_prepare_keeps_the_optimizer_type():
    """The names `import hetrain` gives on first use came from a module __getattr__: a user's type checker
    saw hetrain.Session as Any, and prepare() returned its optimizer as Optional even when one was given."""
    import typing

    import hetrain
    from hetrain.runtime.session import Session

    tree = ast.parse((ROOT / "hetrain" / "__init__.py").read_text())
    checked = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    seen = {(imp.module, alias.name) for imp in checked.body for alias in imp.names}
    assert set(hetrain._LAZY.values()) == seen
    if sys.version_info >= (3, 11):
        returns = [typing.get_type_hints(f)["return"] for f in typing.get_overloads(Session.prepare)]
        import torch
        assert returns == [tuple[torch.nn.Module, torch.optim.Optimizer], tuple[torch.nn.Module, None]]


def test_the_torch_hetrain_requires_is_the_one_a_session_checks_and_the_readme_names():
    """pyproject.toml promised torch>=2.8, where pipelines (schedule.step's return_outputs, schedule.eval), sharded
    checkpoint reads and FSDP2 on gloo (reduce-scatter's AVG summed) fail; 2.11 is the oldest that runs them. A
    torch installed beside hetrain without its requirements is refused when a session starts."""
    from hetrain.errors import HetrainError
    from hetrain.runtime.environment import OLDEST_TORCH, check_torch

    oldest = ".".join(map(str, OLDEST_TORCH))
    assert f"torch>={oldest}" in PROJECT["project"]["dependencies"]
    assert f"TORCH_REQ='torch>={oldest}'" in (ROOT / "README.md").read_text()
    check_torch(f"{oldest}.0+cu130")
    with pytest.raises(HetrainError, match=rf"hetrain needs torch {oldest} or later, and this is torch 2.10.0\+cu128"):
        check_torch("2.10.0+cu128")
