"""Dependencies point one way: server -> decoding -> torch/transformers; server never imports torch.

The tooling package ``bench`` sits beside them: it measures ``decoding`` and reads the server's settings
(``server.config``, the layers that resolve them, ``server.config_layers``, and their command-line flags,
``server.flags``), and drives the worker's loop to time it (``server.worker``), but nothing else of the server;
neither ``decoding`` nor ``server`` imports it. Within each of the three packages no import circle closes,
annotations included.

Inside ``decoding``, imports point one way through its rooms (``decoding/__init__.py`` maps them): the top-level
ground (``params``, ``errors``, ``grammar``) imports no room, each room (``ROOMS``, lowest first) imports only itself,
the rooms before it and the ground, and the top-level modules above the rooms (``batch``, ``batch_policy``,
``calibration``, ``decoder``, ``payoff``, and the package's own lazy face ``decoding``) import anything below them;
a module outside that map fails."""

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
# And the worker's loop, which ``bench.worker_anatomy`` drives in process to time the host work the server adds to a
# step (``server.worker`` with the ``Job`` record it runs, ``server.jobs``, its ``TextStream`` and ``Metrics``, and
# ``server.plans``).
BENCH_MAY_READ = {"server.config", "server.config_layers", "server.flags", "server.spawn", "server.worker",
                  "server.jobs", "server.text", "server.metrics", "server.plans"}


def test_bench_reads_only_the_server_settings() -> None:
    """``bench`` takes the server's defaults from ``server.config`` and ``server.config_layers`` (and ``serve``'s
    flags from ``server.flags``), may start the server as a process (``server.spawn``) or drive its worker's loop
    (``server.worker``, for ``bench.worker_anatomy``), and imports no other server module."""
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


# ``decoding``'s rooms, lowest first; the top-level modules below them (GROUND) and above them (ABOVE_ROOMS).
ROOMS = ["weights", "forward", "proposers", "step"]
GROUND = {"decoding.params", "decoding.errors", "decoding.grammar"}
ABOVE_ROOMS = {"decoding", "decoding.batch", "decoding.batch_policy", "decoding.calibration", "decoding.decoder",
               "decoding.payoff"}
PLACES = ["ground", *ROOMS, "above the rooms"]


def place(module: str) -> int:
    """``module``'s index in ``PLACES``: 0 the ground, then each room in order, last the modules above the rooms.
    Raises ``ValueError`` for a module the map does not place (a new top-level module or subpackage).

    >>> place("decoding.params"), place("decoding.forward.static"), place("decoding.step"), place("decoding.batch")
    (0, 2, 4, 5)
    """
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ROOMS:
        return 1 + ROOMS.index(parts[1])
    if module in GROUND:
        return 0
    if module in ABOVE_ROOMS:
        return len(PLACES) - 1
    raise ValueError(f"{module} is in no room of decoding: add it to ROOMS, GROUND or ABOVE_ROOMS")


def upward_imports(graph: dict[str, set[str]], index: int) -> dict[str, list[str]]:
    """The modules at ``PLACES[index]`` that import a module placed above them, with those imports.

    >>> upward_imports({"decoding.forward.static": {"decoding.step.stream", "decoding.forward.slices"}}, 2)
    {'decoding.forward.static': ['decoding.step.stream']}
    """
    found = {}
    for module, imported in graph.items():
        if place(module) == index:
            upward = sorted(name for name in imported if place(name) > index)
            if upward:
                found[module] = upward
    return found


def test_every_decoding_module_has_a_place():
    graph = import_graph("decoding")
    assert {module.split(".")[1] for module in graph if module.count(".") >= 2} == set(ROOMS)
    for module in graph:
        place(module)


def test_the_room_check_sees_an_upward_import():
    """``decoding.forward.static`` once read ``context_length`` off the stream module of the room above."""
    graph = import_graph("decoding")
    graph["decoding.forward.static"] = graph["decoding.forward.static"] | {"decoding.step.stream"}
    found = upward_imports(graph, place("decoding.forward.static"))
    assert found == {"decoding.forward.static": ["decoding.step.stream"]}


@pytest.mark.parametrize("index", range(len(PLACES) - 1), ids=PLACES[:-1])
def test_decoding_imports_point_down_the_rooms(index):
    assert upward_imports(import_graph("decoding"), index) == {}
