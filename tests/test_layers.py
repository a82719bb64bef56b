"""The import rules of docs/architecture.md, checked on the source: the shared library imports
no service, services never import each other, and only the top layer may import them all."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("verifier_svc", "drafter_svc", "coordinator")
# the top layer: every command, the bench, the demo and the round loop in one process
TOP = {
    "specd/cli.py",
    "coordinator/bench.py",
    "coordinator/concurrency.py",
    "coordinator/demo.py",
    "coordinator/local.py",
}


def imported_packages(path: Path) -> set[str]:
    """First names of every module `path` imports, at any depth of the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def layer_violations() -> list[str]:
    found = []
    for package in ("specd", *SERVICES):
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            if where in TOP:
                continue
            others = {s for s in SERVICES if s != package}
            for name in sorted(imported_packages(path) & others):
                found.append(f"{where} imports {name}")
    return found


def test_the_shared_library_and_each_service_import_no_other_service():
    assert layer_violations() == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from verifier_svc.engine import Target\n    import coordinator\n"
    )
    assert imported_packages(module) >= {"verifier_svc", "coordinator"}
