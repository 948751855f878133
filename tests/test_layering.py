"""Dependencies point one way: server -> decoding -> torch/transformers; server never imports torch.

The tooling package ``bench`` sits beside them: it measures ``decoding`` and reads the server's settings
(``server.config``, the layers that resolve them, ``server.config_layers``, and their command-line flags,
``server.flags``) but nothing else of the server; neither ``decoding`` nor ``server`` imports it. Within each of
the three packages no import circle closes, annotations included."""

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
        (
            "decoding",
            {"server", "bench", "fastapi", "starlette", "sse_starlette", "uvicorn", "prometheus_client", "asyncio"},
        ),
        ("server", {"torch", "bench"}),
        ("bench", {"fastapi", "starlette", "sse_starlette", "uvicorn", "prometheus_client", "asyncio"}),
    ],
)
def test_imports_point_one_way(package, forbidden):
    modules = imported_modules(package)
    assert modules, f"no modules found in {package}"
    offenders = {path: names & forbidden for path, names in modules.items() if names & forbidden}
    assert offenders == {}


# The server's settings (their definition, and the layers that resolve a device preset's values: server.config
# was both before it was split) and their flags; and server.spawn (standard library only: it starts ``python -m
# server`` as a process, for the GPU check's start-up timing, as it does for scripts and tests).
BENCH_MAY_READ = {"server.config", "server.config_layers", "server.flags", "server.spawn"}


def test_bench_reads_only_the_server_settings() -> None:
    """``bench`` takes the server's defaults from ``server.config`` and ``server.config_layers`` (and ``serve``'s
    flags from ``server.flags``), may start the server as a process (``server.spawn``), and imports no other server
    module."""
    offenders = {}
    for path in (ROOT / "bench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            bad = [name for name in names if name.split(".")[0] == "server" and name not in BENCH_MAY_READ]
            if bad:
                offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}


def import_graph(package: str) -> dict[str, set[str]]:
    """Each module of ``package``'s imports of the package's other modules, at any depth of the file (imports
    inside functions, and those under ``if TYPE_CHECKING:``, included: a circle of annotations is still a circle
    a reader walks)."""
    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
               for path in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = found & set(modules) - {name}
    return graph


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle a depth-first walk of ``graph`` meets, each as the path that closes it.

    >>> cycles_of({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    [['a', 'b', 'c', 'a']]
    """
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph[module]):
            if imported in path:
                cycles.append(path[path.index(imported):] + [imported])
            elif imported not in done:
                visit(imported, [*path, imported])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return cycles


def test_the_walk_sees_function_level_and_annotation_imports():
    graph = import_graph("server")
    assert graph["server.cli"] >= {"server.app"}  # serve's import, inside the function
    assert graph["server.chat"] >= {"server.runtime"}  # under TYPE_CHECKING


@pytest.mark.parametrize("package", ["decoding", "server", "bench"])
def test_modules_import_each_other_without_circles(package):
    assert cycles_of(import_graph(package)) == []
