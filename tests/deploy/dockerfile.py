"""A small Dockerfile reader for tests: instructions, stages, exec-form arguments and .dockerignore matching.

Contract: ``read_instructions(text)`` joins continuation lines, drops comments and parser directives, and
returns one ``Instruction`` per line with its stage (``None`` for global ``ARG``s before the first ``FROM``).
It follows the Dockerfile reference closely enough to check our own Dockerfile, not every Dockerfile.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass

VARIANTS = ("cpu", "cuda")  # values of the Dockerfile's VARIANT build argument
_FROM = re.compile(r"^(?:--\S+\s+)*(?P<image>\S+)(?:\s+AS\s+(?P<name>\S+))?\s*$", re.IGNORECASE)
_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: upper-cased keyword, raw arguments, the stage it belongs to."""

    keyword: str
    args: str
    stage: str | None
    line: int


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each instruction, continuations joined, comment lines dropped."""
    lines, buffer, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer += stripped[:-1].rstrip() + " "
            continue
        lines.append((start, buffer + stripped))
        buffer = ""
    if buffer:
        lines.append((start, buffer.strip()))
    return lines


def read_instructions(text: str) -> list[Instruction]:
    """Every instruction of a Dockerfile in order, each tagged with its stage name (or index)."""
    instructions, stage, index = [], None, -1
    for number, line in _logical_lines(text):
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            index += 1
            match = _FROM.match(args)
            stage = match.group("name") if match and match.group("name") else str(index)
        instructions.append(Instruction(keyword, args, stage, number))
    return instructions


def from_image(instruction: Instruction) -> str:
    """The image (or stage) a ``FROM`` instruction builds on."""
    match = _FROM.match(instruction.args)
    assert match, f"unreadable FROM on line {instruction.line}: {instruction.args}"
    return match.group("image")


def exec_form(args: str) -> list[str]:
    """The JSON (exec) form of CMD / ENTRYPOINT / RUN arguments; fails on the shell form."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(item, str) for item in value), args
    return value


def arg_defaults(instructions: list[Instruction], stage: str | None) -> dict[str, str]:
    """``ARG name=default`` values declared in ``stage`` (``None``: the global ones before the first FROM)."""
    defaults = {}
    for instruction in instructions:
        if instruction.keyword == "ARG" and instruction.stage == stage:
            name, _, default = instruction.args.partition("=")
            defaults[name.strip()] = default.strip().strip('"')
    return defaults


def env_values(instructions: list[Instruction], stage: str) -> dict[str, str]:
    """``ENV key=value`` pairs set in one stage (the ``key=value`` form only)."""
    values = {}
    for instruction in instructions:
        if instruction.keyword == "ENV" and instruction.stage == stage:
            for item in shlex.split(instruction.args):
                key, sep, value = item.partition("=")
                assert sep, f"ENV on line {instruction.line} must use key=value"
                values[key] = value
    return values


def expand(text: str, variables: dict[str, str]) -> str:
    """Expand ``$NAME``, ``${NAME}`` and ``${NAME:-default}`` from ``variables``."""

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        return variables.get(name) or (match.group(2) or "")

    return _VARIABLE.sub(replace, text)


def copy_sources(instruction: Instruction) -> list[str]:
    """Source paths of a COPY / ADD from the build context (empty for ``--from=`` copies)."""
    parts = exec_form(instruction.args) if instruction.args.startswith("[") else shlex.split(instruction.args)
    if any(part.startswith("--from=") for part in parts):
        return []
    parts = [part for part in parts if not part.startswith("--")]
    return parts[:-1]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether ``.dockerignore`` ``patterns`` exclude the context-relative ``path`` (last match wins)."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        candidates = [pattern, pattern.replace("**/", "")]
        parts = path.strip("/").split("/")
        prefixes = ["/".join(parts[: end + 1]) for end in range(len(parts))]
        if any(fnmatch.fnmatchcase(prefix, candidate) for prefix in prefixes for candidate in candidates):
            excluded = not negate
    return excluded


def read_dockerignore(text: str) -> list[str]:
    """The patterns of a ``.dockerignore`` file, comments and blank lines dropped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def final_stage(instructions: list[Instruction]) -> str:
    """The name of the last stage (what ``docker build`` produces without --target)."""
    return [instruction.stage for instruction in instructions if instruction.keyword == "FROM"][-1]


def only(instructions: list[Instruction], keyword: str, stage: str) -> Instruction:
    """The last ``keyword`` instruction of ``stage`` (Docker keeps only the last ENTRYPOINT, CMD, ...)."""
    found = [i for i in instructions if i.keyword == keyword and i.stage == stage]
    assert found, f"no {keyword} in stage {stage}"
    return found[-1]


def runtime_env(instructions: list[Instruction]) -> dict[str, str]:
    """ENV of the final stage, including what its base stage set."""
    stage = final_stage(instructions)
    base = from_image(only(instructions, "FROM", stage))
    values = {}
    for variant in VARIANTS:
        values |= env_values(instructions, base.replace("${VARIANT}", variant))
    return values | env_values(instructions, stage)


def exposed_port(instructions: list[Instruction]) -> int:
    """The single TCP port the image exposes."""
    ports = only(instructions, "EXPOSE", final_stage(instructions)).args.split()
    assert len(ports) == 1
    return int(ports[0].removesuffix("/tcp"))


def cli_argv(instructions: list[Instruction]) -> list[str]:
    """What the container runs by default: ENTRYPOINT followed by CMD."""
    stage = final_stage(instructions)
    entrypoint = exec_form(only(instructions, "ENTRYPOINT", stage).args)
    return entrypoint + exec_form(only(instructions, "CMD", stage).args)
