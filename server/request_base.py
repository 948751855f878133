"""What every request model shares (``server.protocol``, ``server.messages``): the strict base model, and the
helpers that state in the JSON schema a rule the endpoint checks in code.

Contract: ``StrictModel`` is strict (``"8"`` where an int belongs fails), ignores unknown fields and refuses NaN and
infinity. ``described(**keywords)`` is a field whose schema carries ``keywords`` (checked by the endpoint, with its own
message); ``configured(**settings)`` one whose schema keywords take their values from server settings, under
``SETTINGS_KEY`` (filled in by ``server.openapi``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SETTINGS_KEY = "x-settings"  # schema keyword -> the server setting that gives its value (``configured``)


def described(**keywords: Any) -> Any:
    """The JSON schema keywords of a rule the endpoint checks in code, in its place among the request's checks and
    with its own message (``suffix``: ``described(maxLength=0)``, refused by ``server.completions``)."""
    return Field(json_schema_extra=keywords)


def configured(**settings: str) -> Any:
    """JSON schema keywords whose values are server settings (``n``: ``configured(maximum="max_n")``), filled in by
    ``server.openapi``; the endpoint checks them in code."""
    return Field(json_schema_extra={SETTINGS_KEY: settings})


class StrictModel(BaseModel):
    """Base of request models: strict types, unknown fields ignored, no NaN or infinity."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
