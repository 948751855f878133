"""The docs say what the code does: README's flag table is the CLI's, and every relative link resolves, to a heading
of its page where it names one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from server import cli
from server.config import ServerConfig
from server.config_layers import DEVICE_PRESETS, load_config
from server.flags import config_flags

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ROW = re.compile(r"^\|\s*`?(--[a-z][a-z0-9-]*)`?\s*\|\s*([^|]*?)\s*\|")


def common_flag_rows() -> list[tuple[str, str]]:
    """``(flag, default cell)`` of each row of README's "Common flags" table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Common flags", 1)[1].split("\n## ", 1)[0]
    return [match.groups() for line in section.splitlines() if (match := ROW.match(line))]


def serve_options() -> set[str]:
    serve = cli.build_parser()._subparsers._group_actions[0].choices["serve"]
    return {option for action in serve._actions for option in action.option_strings}


def expected_defaults(flag: str) -> dict[str, object]:
    """What each device preset runs for ``flag``; for ``--device``, which picks the preset, the flag's default."""
    key = next(item.key for item in config_flags() if item.name == flag)
    if key == "device":
        return dict.fromkeys(DEVICE_PRESETS, ServerConfig().device)
    found = {}
    for name in DEVICE_PRESETS:
        value = load_config(device_preset=name)
        for part in key.split("."):
            value = getattr(value, part)
        found[name] = "none" if value is None else value  # README writes an unset value as "none"
    return found


def parse_default(cell: str) -> dict[str, object]:
    """A default cell as YAML values per device preset (one value stands for every preset).

    >>> parse_default("cpu 1 / cuda 30"), parse_default("30")
    ({'cpu': 1, 'cuda': 30}, {'cpu': 30, 'cuda': 30})
    """
    parts = [part.split(" ", 1) for part in cell.split(" / ")]
    if len(parts) == 1:
        return {name: yaml.safe_load(cell) for name in DEVICE_PRESETS}
    return {name: yaml.safe_load(value) for name, value in parts}


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260


def test_readme_common_flags_are_the_clis_with_their_defaults():
    rows = common_flag_rows()
    assert len(rows) >= 8, "README's '## Common flags' table is missing or nearly empty"
    options = serve_options()
    for flag, default in rows:
        assert flag in options, f"README lists {flag}, which `lookahead-server serve` does not have"
        if flag == "--config":
            continue
        assert parse_default(default.strip("`")) == expected_defaults(flag), f"README's default for {flag}: {default}"


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces made hyphens.

    >>> heading_anchor("2026-11-25 evening: the pool's suffixes at G=32 (`python -m bench.sampled`)")
    '2026-11-25-evening-the-pools-suffixes-at-g32-python--m-benchsampled'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks; a repeated heading's get ``-1``, ``-2``...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (match := re.match(r"#{1,6} (.*)", line)):
            anchor = heading_anchor(match.group(1))
            found.add(f"{anchor}-{seen[anchor]}" if anchor in seen else anchor)
            seen[anchor] = seen.get(anchor, 0) + 1
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_links_to_headings_resolve(path):
    """A link to ``page.md#anchor`` (or ``#anchor`` on the same page) lands on a heading of that page."""
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", path.read_text()):
        page = path.parent / target if target else path
        if "://" in target or page.suffix != ".md" or not page.exists():
            continue
        assert anchor in anchors(page), f"{path.name} links to {target}#{anchor}, a heading {page.name} does not have"
