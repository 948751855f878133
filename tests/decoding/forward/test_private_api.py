"""Every private torch / transformers API ``decoding`` uses (``decoding.forward.private_api``) exists in the installed
versions. Verified with torch 2.13.0 and transformers 5.23.0 (``TESTED_VERSIONS``); after an upgrade, a failure
here names the API that disappeared and the module to fix."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers

from decoding.forward import private_api
from decoding.forward.private_api import PRIVATE_APIS, TESTED_VERSIONS

ROOT = Path(__file__).resolve().parents[3]


def installed() -> str:
    return f"torch {torch.__version__}, transformers {transformers.__version__}"


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda api: api.name)
def test_private_api_exists_in_the_installed_versions(api: private_api.PrivateApi) -> None:
    if not api.applies():
        pytest.skip(f"{api.name}: not used on this build ({api.used_by} falls back)")
    tested = ", ".join(f"{name} {version}" for name, version in TESTED_VERSIONS.items())
    assert api.check(), (
        f"{api.name} (used by {api.used_by}: {api.why}) is missing or changed in {installed()}; "
        f"it was verified with {tested}. Adapt {api.used_by} and its entry in decoding/forward/private_api.py."
    )


def test_the_stated_versions_are_the_ones_pinned() -> None:
    """TESTED_VERSIONS names the torch the Makefile installs; transformers within pyproject's range."""
    makefile = (ROOT / "Makefile").read_text()
    assert f"torch=={TESTED_VERSIONS['torch']}" in makefile
    assert TESTED_VERSIONS["transformers"].split(".")[0] == "5"  # pyproject: transformers>=5.0,<6


def test_a_missing_api_is_reported() -> None:
    gone = private_api.PrivateApi("torch.ops.mkldnn._no_such_op", "decoding.weights.linears", "test",
                                  private_api.exists("torch.ops.mkldnn._no_such_op"))
    assert not gone.check()
    assert not private_api.exists("transformers.cache_utils.NoSuchLayer")()
    assert not private_api.has_members("transformers.cache_utils.DynamicLayer", ("no_such_hook",))()


PRIVATE_NAME_PREFIXES = ("torch.ops.", "torch._", "transformers.cache_utils", "transformers.masking_utils")


def private_references(path: Path) -> set[str]:
    """Dotted names in ``path`` that start with a private / internal prefix, and ``from`` imports of internal
    transformers modules."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            text = ast.unparse(node)
            if text.startswith(PRIVATE_NAME_PREFIXES):
                found.add(text)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PRIVATE_NAME_PREFIXES):
            found.add(node.module)
    return found


def test_every_private_reference_in_decoding_is_registered() -> None:
    """A new ``torch.ops.*`` / ``torch._*`` / internal transformers module use in decoding/ must be listed too
    (underscored attributes of library objects, like a config's ``_attn_implementation_internal``, are listed
    by hand: the scan cannot tell them from our own)."""
    registered = [api.name for api in PRIVATE_APIS]
    unlisted = {}
    for path in sorted((ROOT / "decoding").rglob("*.py")):  # every room
        if path.name == "private_api.py":
            continue
        names = {name for name in private_references(path) if not registered_prefix(name, registered)}
        if names:
            unlisted[str(path.relative_to(ROOT))] = sorted(names)
    assert unlisted == {}, f"private APIs used but not in decoding/forward/private_api.py: {unlisted}"


def registered_prefix(name: str, registered: list[str]) -> bool:
    """Whether ``name`` is listed, or is a namespace of a listed name (``torch.ops.mkldnn`` of
    ``torch.ops.mkldnn._linear_pointwise``; ``transformers.cache_utils`` of ``...cache_utils.DynamicLayer``)."""
    return any(entry == name or entry.startswith(name + ".") for entry in registered)
