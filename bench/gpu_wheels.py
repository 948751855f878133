"""The wheels a GPU machine that reaches no registry needs: the server's requirement tree, less the GPU image.

Contract: ``plan_wheels(roots, installed, image, environment)`` walks the requirement tree from ``roots`` (the
project's runtime dependencies, ``project_requirements``, plus ``GPU_CHECK_ROOTS``: what the GPU check's load test
imports beyond the server), with each requirement's marker evaluated for ``environment`` (``target_environment``:
CPython 3.12 on Linux x86-64 unless told otherwise) and the extras asked for. Each distribution it reaches is
either taken from the image or carried, at the version ``installed`` (this ``.venv``) holds:

- not on the image (``image``: ``scripts/gpu-image-packages.txt``, ``read_image_packages``): carried;
- on the image at a known version: the image's when that version meets every bound on it, else carried
  (torch, triton and the CUDA libraries never are: a bound they miss is a conflict, for a person to settle);
- on the image at an unknown version: the image's when nothing bounds it; carried when something does and its
  wheel is pure Python (small, and the image's may be older than the bound); else the image's, trusted.

Only the requirements of the roots and of carried distributions count: a distribution the image provides brings
its own dependencies there. A requirement the walk reaches that ``installed`` lacks is listed in ``missing``.

Example (made-up tree): roots ``["fastapi>=0.110"]``; ``fastapi`` requires ``anyio>=4.1`` and ``starlette``;
``anyio`` requires ``idna>=2.8``. With ``image = {"anyio": None, "idna": None}`` (versions unknown) and all of
them pure Python in ``installed``: ``fastapi`` and ``starlette`` are carried (not on the image), ``anyio`` is
carried (bounded by ``>=4.1``), and so ``idna`` is too (``anyio``, carried, bounds it).

``python -m bench.gpu_wheels [--python-version 3.12] [--dest DIR]`` prints the plan and, with ``--dest``,
downloads the carried wheels there (``pip download --no-deps``, binary only, for that CPython on manylinux
x86-64); ``scripts/gpu-pack`` calls it. Exit status 1 when the plan has a conflict or a download fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PACKAGES = ROOT / "scripts" / "gpu-image-packages.txt"
PROJECT = "<project>"
# What the GPU check runs beyond the server: scripts/loadtest.py's clients (the bounds of pyproject's dev extra).
GPU_CHECK_ROOTS = ("openai>=1.40", "httpx>=0.27")
NEVER_CARRIED = ("torch", "triton", "nvidia-", "cuda-")  # names, or name prefixes ending in "-"
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass(frozen=True)
class Installed:
    """One distribution of this environment: its version, whether its wheel is pure Python, its requirements."""

    name: str
    version: str
    pure: bool
    requires: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    """Where one distribution comes from on the GPU machine, and why."""

    name: str
    version: str | None  # this environment's (what a carried wheel is); None when it is not installed here
    carried: bool
    reason: str


@dataclass
class WheelPlan:
    """The walk's outcome: every distribution reached, decided, and what needs a person."""

    decisions: dict[str, Decision] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # reached, not on the image, not installed here
    conflicts: list[str] = field(default_factory=list)  # never-carried distributions whose image version misses

    @property
    def carried(self) -> list[Decision]:
        """The distributions to carry as wheels, by name."""
        return sorted((d for d in self.decisions.values() if d.carried), key=lambda d: d.name)

    @property
    def from_image(self) -> list[Decision]:
        """The distributions the image provides, by name."""
        return sorted((d for d in self.decisions.values() if not d.carried), key=lambda d: d.name)


def target_environment(python_version: str = "3.12") -> dict[str, str]:
    """Marker variables of CPython ``python_version`` (``"3.12"``) on Linux x86-64."""
    return {"implementation_name": "cpython", "implementation_version": f"{python_version}.0", "os_name": "posix",
            "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "", "python_full_version": f"{python_version}.0",
            "python_version": python_version, "sys_platform": "linux"}


def never_carried(name: str) -> bool:
    """Whether ``name`` is torch, triton or a CUDA library (what the image must provide)."""
    return any(name.startswith(prefix) if prefix.endswith("-") else name == prefix for prefix in NEVER_CARRIED)


def read_image_packages(path: Path = IMAGE_PACKAGES) -> dict[str, str | None]:
    """``{canonical name: version or None}`` from lines ``name`` or ``name==version`` (``#`` starts a comment)."""
    packages: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            name, _, version = entry.partition("==")
            packages[canonicalize_name(name.strip())] = version.strip() or None
    return packages


def installed_distributions(distributions: Iterable[importlib.metadata.Distribution] | None = None,
                            ) -> dict[str, Installed]:
    """``{canonical name: Installed}`` of this environment (``importlib.metadata.distributions()``)."""
    found: dict[str, Installed] = {}
    for dist in importlib.metadata.distributions() if distributions is None else distributions:
        name = dist.metadata["Name"]
        if not name:
            continue
        wheel = dist.read_text("WHEEL") or ""
        pure = "root-is-purelib: true" in wheel.lower()
        found.setdefault(canonicalize_name(name), Installed(canonicalize_name(name), dist.version, pure,
                                                            tuple(dist.requires or ())))
    return found


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """``[project].dependencies`` of this checkout (the runtime requirements, no extras)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the installed metadata says the same
        return [text for text in importlib.metadata.requires("lookahead-server") or () if "extra ==" not in text]
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def _applies(requirement: Requirement, environment: Mapping[str, str], extras: Iterable[str]) -> bool:
    """Whether ``requirement`` holds in ``environment`` for the base install or one of ``extras``."""
    if requirement.marker is None:
        return True
    marker: Marker = requirement.marker
    return any(marker.evaluate({**environment, "extra": extra}) for extra in ("", *extras))


def _decide(name: str, bounds: Sequence[SpecifierSet], installed: Installed | None,
            image: Mapping[str, str | None]) -> tuple[bool, str]:
    """(carried, reason) for ``name`` under its ``bounds`` (the module contract's rules)."""
    joined = ",".join(str(bound) for bound in bounds if str(bound))
    if name not in image:
        return True, "not on the GPU image"
    version = image[name]
    if version is not None:
        try:
            meets = all(bound.contains(Version(version), prereleases=True) for bound in bounds)
        except InvalidVersion:
            meets = False
        if meets:
            return False, f"the image's {version} meets {joined or 'no bound'}"
        return True, f"the image's {version} misses {joined}"
    if not joined:
        return False, "on the image, unbounded"
    if installed is not None and installed.pure:
        return True, f"the image's version is unknown and {joined} bounds it: carried (pure Python)"
    return False, f"the image's version is unknown, {joined} bounds it, not pure Python: the image's trusted"


def plan_wheels(roots: Sequence[str], installed: Mapping[str, Installed], image: Mapping[str, str | None],
                environment: Mapping[str, str]) -> WheelPlan:
    """Walk the requirement tree and decide every distribution it reaches (module contract)."""
    bounds: dict[str, list[SpecifierSet]] = {}
    extras: dict[str, set[str]] = {}
    expanded: set[tuple[str, str]] = set()  # (distribution, extra) whose requirements were added
    plan = WheelPlan()

    def add(requirement_texts: Iterable[str], parent_extras: Iterable[str]) -> None:
        for text in requirement_texts:
            requirement = Requirement(text)
            if not _applies(requirement, environment, parent_extras):
                continue
            name = canonicalize_name(requirement.name)
            bounds.setdefault(name, []).append(requirement.specifier)
            extras.setdefault(name, set()).update(requirement.extras)

    add(roots, ())
    changed = True
    while changed:
        changed = False
        for name in sorted(bounds):
            carried, reason = _decide(name, bounds[name], installed.get(name), image)
            if carried and never_carried(name):
                carried, reason = False, f"{reason}: never carried"
            dist = installed.get(name)
            plan.decisions[name] = Decision(name, dist.version if dist else None, carried, reason)
            if not carried or dist is None:
                continue
            for extra in ("", *sorted(extras[name])):
                if (name, extra) not in expanded:
                    expanded.add((name, extra))
                    changed = True
                    add(dist.requires, (extra,) if extra else ())
    plan.missing = sorted(d.name for d in plan.decisions.values() if d.carried and d.version is None)
    plan.conflicts = sorted(f"{d.name}: {d.reason}" for d in plan.decisions.values()
                            if never_carried(d.name) and d.reason.endswith("never carried"))
    return plan


def download(plan: WheelPlan, dest: Path, python_version: str = "3.12") -> int:
    """``pip download`` the carried wheels into ``dest`` (binary only, no dependencies); pip's exit status."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{d.name}=={d.version}" for d in plan.carried if d.version is not None]
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", *platforms, "-d", str(dest), *pins]
    return subprocess.run(command).returncode


def describe(plan: WheelPlan) -> str:
    """The plan as lines: carried, from the image, missing, conflicts."""
    lines = [f"carried ({len(plan.carried)}):"]
    lines += [f"  {d.name}=={d.version}: {d.reason}" for d in plan.carried]
    lines += [f"from the image ({len(plan.from_image)}):"]
    lines += [f"  {d.name}: {d.reason}" for d in plan.from_image]
    lines += [f"missing here: {name}" for name in plan.missing]
    lines += [f"conflict: {text}" for text in plan.conflicts]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan; download it with ``--dest``. 1 on a conflict, a missing distribution or a failed download."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_wheels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's CPython (3.12)")
    parser.add_argument("--dest", type=Path, help="download the carried wheels here")
    parser.add_argument("--image", type=Path, default=IMAGE_PACKAGES, help="the image's package list")
    args = parser.parse_args(argv)
    plan = plan_wheels([*project_requirements(), *GPU_CHECK_ROOTS], installed_distributions(),
                       read_image_packages(args.image), target_environment(args.python_version))
    print(describe(plan))
    if plan.conflicts or plan.missing:
        return 1
    if args.dest is not None and download(plan, args.dest, args.python_version) != 0:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
