"""The GPU machine's wheels: the walk's rules on made-up trees, and on this environment the plan covers every
distribution that the server, the SDK and the load test import, with only the image's and the carried ones there."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from bench import gpu_wheels
from bench.gpu_wheels import Installed, plan_wheels, read_image_packages, target_environment

ROOT = Path(__file__).resolve().parents[2]
PY312 = target_environment("3.12")


def tree(**requires: tuple[str, ...]) -> dict[str, Installed]:
    """Pure-Python distributions at 1.0 with the given requirements (names with ``_`` for ``-``)."""
    return {name.replace("_", "-"): Installed(name.replace("_", "-"), "1.0", True, reqs)
            for name, reqs in requires.items()}


def test_the_docstring_example():
    installed = tree(fastapi=("anyio>=4.1", "starlette"), anyio=("idna>=2.8",), starlette=(), idna=())
    plan = plan_wheels(["fastapi>=0.110"], installed, {"anyio": None, "idna": None}, PY312)
    assert [d.name for d in plan.carried] == ["anyio", "fastapi", "idna", "starlette"]
    assert not plan.from_image and not plan.missing and not plan.conflicts


def test_a_known_image_version_is_used_when_it_meets_every_bound_and_its_dependencies_are_not_walked():
    installed = tree(app=("lib>=2", "old>=5"), lib=("deep",), old=(), deep=())
    plan = plan_wheels(["app"], installed, {"lib": "2.3", "old": "4.0", "deep": None}, PY312)
    assert {d.name: d.carried for d in plan.decisions.values()} == {"app": True, "lib": False, "old": True}


def test_unknown_image_versions_unbounded_or_compiled_stay_the_images():
    installed = {**tree(app=("free", "bounded>=1", "compiled>=1")), "free": Installed("free", "1.0", True),
                 "bounded": Installed("bounded", "1.0", True), "compiled": Installed("compiled", "1.0", False)}
    plan = plan_wheels(["app"], installed, {"free": None, "bounded": None, "compiled": None}, PY312)
    assert [d.name for d in plan.carried] == ["app", "bounded"]
    assert "trusted" in plan.decisions["compiled"].reason


def test_markers_are_evaluated_for_the_target_python_and_extras_are_followed():
    installed = tree(app=("backport; python_version < '3.11'", "web[fast]", "win; sys_platform == 'win32'"),
                     web=("speedups; extra == 'fast'", "docs; extra == 'docs'"), speedups=(), backport=(), docs=(),
                     win=())
    names = {d.name for d in plan_wheels(["app"], installed, {}, PY312).carried}
    assert names == {"app", "web", "speedups"}
    assert "backport" in {d.name for d in plan_wheels(["app"], installed, {}, target_environment("3.10")).carried}


def test_torch_is_never_carried_a_missed_bound_is_a_conflict():
    plan = plan_wheels(["torch>=9", "nvidia-cublas>=99"], {}, {"torch": "2.11.0", "nvidia-cublas": None}, PY312)
    assert not plan.carried and plan.conflicts == ["torch: the image's 2.11.0 misses >=9: never carried"]


def test_what_is_not_installed_here_is_missing():
    plan = plan_wheels(["app"], tree(app=("ghost>=1",)), {}, PY312)
    assert plan.missing == ["ghost"]


def test_the_image_list_has_the_versions_the_notes_state():
    image = read_image_packages()
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0"
    assert "anyio" in image and image["anyio"] is None and "fastapi" not in image


def this_plan(python_version: str) -> gpu_wheels.WheelPlan:
    return plan_wheels([*gpu_wheels.project_requirements(), *gpu_wheels.GPU_CHECK_ROOTS],
                       gpu_wheels.installed_distributions(), read_image_packages(), target_environment(python_version))


def test_this_environments_plan_for_the_gpu_machine_is_whole():
    plan = this_plan("3.12")
    assert not plan.conflicts and not plan.missing
    carried = {d.name for d in plan.carried}
    # What broke on 2026-11-27 (shared/docs/gpu-notes.md): all carried now, by the walk.
    assert {"fastapi", "openai", "opentelemetry-api", "httpx2", "httpcore2", "truststore", "anyio", "idna"} <= carried
    assert "torch" not in carried and "transformers" not in carried


def allowed_site(tmp_path: Path, allowed: set[str]) -> Path:
    """A folder of links to the top-level files of the ``allowed`` distributions of this environment."""
    site = tmp_path / "site"
    site.mkdir()
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name not in allowed or name == "lookahead-server":
            continue
        base = Path(dist.locate_file(""))
        for top in sorted({Path(str(path)).parts[0] for path in dist.files or ()} - {".."}):
            if (base / top).exists() and not (site / top).exists() and not top.endswith(".pth"):
                (site / top).symlink_to(base / top)
    return site


IMPORTS = """
import importlib.util, json, runpy, sys
import server.app, server.cli, openai, bench.gpu, bench.heldout
spec = importlib.util.spec_from_file_location("loadtest", "scripts/loadtest.py")
module = importlib.util.module_from_spec(spec); sys.modules["loadtest"] = module; spec.loader.exec_module(module)
sys.argv = ["server", "--help"]
try:
    runpy.run_module("server", run_name="__main__")
except SystemExit as done:
    assert done.code in (0, None), done.code
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.slow
def test_the_server_the_sdk_and_the_load_test_import_with_only_the_image_and_the_carried_wheels(tmp_path):
    """Here, on this Python: a site of only the image's and the carried distributions (at this .venv's versions).

    Stricter than checking the distribution of each module the imports load here: that closure holds optional
    imports a library makes only because this .venv has them (trio, watchfiles, python_multipart...), and a
    distribution that a library needs but this walk missed fails the import here, naming the module.
    """
    plan = this_plan(f"{sys.version_info.major}.{sys.version_info.minor}")
    allowed = {d.name for d in plan.carried} | set(read_image_packages())
    site = allowed_site(tmp_path, allowed)
    code = f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(site)!r}]\n{IMPORTS}"
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    modules = json.loads(done.stdout.splitlines()[-1])
    assert "fastapi" in modules and "httpx2" in modules and "uvicorn" in modules
