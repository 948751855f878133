"""Import a file of ``scripts/`` (not a package) as a module, for tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def script_path(name: str) -> Path:
    """``scripts/<name>.py`` of this checkout."""
    return ROOT / "scripts" / f"{name}.py"


def load_script(name: str) -> ModuleType:
    """Execute ``scripts/<name>.py`` once as module ``name`` (registered in ``sys.modules``) and return it."""
    spec = importlib.util.spec_from_file_location(name, script_path(name))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
