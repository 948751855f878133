"""JSON schemas as the server enforces them: objects that close.

Contract: ``closed_schema(schema, strict)`` returns a copy of a request's JSON schema (``response_format`` or a
tool's ``parameters``) in which objects generate only what they declare; the grammar is built from that copy,
and any output of it is valid against the schema as sent.

- An object that lists ``properties`` and says nothing of ``additionalProperties`` (nor ``patternProperties`` or
  ``unevaluatedProperties``) is closed: ``additionalProperties: false``. JSON Schema leaves such an object open,
  and a small model fills the opening with keys the schema never named until ``max_tokens`` (vLLM's default
  grammar backend closes it too). An object that lists no properties stays open (any object), and
  ``additionalProperties: true`` or a schema keeps an object open.
- With ``strict`` (OpenAI's structured outputs), OpenAI's strict rules apply: every object is closed unless it
  says otherwise, even one without properties, and every property is required.

Subschemas are followed through ``properties``, ``patternProperties``, ``additionalProperties``, ``items``,
``prefixItems``, ``anyOf``, ``oneOf``, ``allOf``, ``$defs`` and ``definitions``; other keywords are kept as they are.
"""

from __future__ import annotations

from typing import Any

OPENING_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # lists of subschemas
SCHEMA_VALUES = ("additionalProperties", "items")  # a subschema (``items`` may also be a list)


def closed_schema(schema: Any, strict: bool = False) -> Any:
    """``schema`` with its objects closed (module contract); booleans and non-schemas come back as they are.

    >>> closed_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    {'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'additionalProperties': False}
    >>> closed_schema({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["b"]}, strict=True)["required"]
    ['a', 'b']
    >>> closed_schema({"type": "object"}), closed_schema({"type": "object"}, strict=True)
    ({'type': 'object'}, {'type': 'object', 'additionalProperties': False})
    """
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed_member(key, value, strict) for key, value in schema.items()}
    if _is_object(closed) and not any(keyword in closed for keyword in OPENING_KEYWORDS):
        if strict or "properties" in closed:
            closed["additionalProperties"] = False
    if strict and _is_object(closed) and isinstance(closed.get("properties"), dict):
        declared = list(closed["properties"])
        closed["required"] = declared + [name for name in closed.get("required", []) if name not in declared]
    return closed


def _closed_member(key: str, value: Any, strict: bool) -> Any:
    """A schema member with the subschemas it holds closed."""
    if key in SCHEMA_MAPS and isinstance(value, dict):
        return {name: closed_schema(item, strict) for name, item in value.items()}
    if key in SCHEMA_LISTS and isinstance(value, list):
        return [closed_schema(item, strict) for item in value]
    if key in SCHEMA_VALUES:
        return [closed_schema(item, strict) for item in value] if isinstance(value, list) \
            else closed_schema(value, strict)
    return value


def _is_object(schema: dict[str, Any]) -> bool:
    """True for a schema of objects: ``type`` "object" (alone or in a list), or no type but ``properties``."""
    kind = schema.get("type")
    if kind is None:
        return "properties" in schema
    return kind == "object" or (isinstance(kind, list) and "object" in kind)
