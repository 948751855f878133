"""Dependencies point one way: server -> decoding -> torch/transformers; server never imports torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> dict[str, set[str]]:
    """Top-level module names imported by each file of ``package``."""
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("decoding", {"server", "fastapi", "starlette", "sse_starlette", "uvicorn", "prometheus_client", "asyncio"}),
        ("server", {"torch"}),
    ],
)
def test_imports_point_one_way(package, forbidden):
    modules = imported_modules(package)
    assert modules, f"no modules found in {package}"
    offenders = {path: names & forbidden for path, names in modules.items() if names & forbidden}
    assert offenders == {}
