"""``server.schemas.closed_schema``: objects close where they list properties (and everywhere under strict), every
property is required under strict, and explicit openings stay open."""

from __future__ import annotations

from server.schemas import closed_schema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"label": {"type": "string"}}}},
        "extra": {"type": "object"},
        "notes": {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
        "either": {"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}}, {"type": "null"}]},
        "ref": {"$ref": "#/$defs/Point"},
    },
    "required": ["name"],
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
}


def test_objects_with_properties_close_and_the_rest_stays_as_sent():
    closed = closed_schema(PERSON)
    properties = closed["properties"]
    assert closed["additionalProperties"] is False and closed["required"] == ["name"]
    assert properties["address"]["additionalProperties"] is False
    assert properties["tags"]["items"]["additionalProperties"] is False
    assert properties["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["Point"]["additionalProperties"] is False
    assert "additionalProperties" not in properties["extra"]  # no properties listed: any object
    assert properties["notes"]["additionalProperties"] is True  # explicitly open
    assert "additionalProperties" not in PERSON["properties"]["address"], "the request's schema is not modified"


def test_strict_closes_every_object_and_requires_every_property():
    closed = closed_schema(PERSON, strict=True)
    assert closed["required"] == list(PERSON["properties"])
    assert closed["properties"]["extra"] == {"type": "object", "additionalProperties": False}
    assert closed["properties"]["address"]["required"] == ["city"]
    assert closed["$defs"]["Point"]["required"] == ["x", "y"]
    assert closed["properties"]["notes"]["additionalProperties"] is True  # an explicit opening still holds


def test_schemas_without_objects_and_open_keywords_pass_through():
    assert closed_schema(True) is True
    assert closed_schema({"type": "string"}) == {"type": "string"}
    patterned = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {"type": "integer"}}}
    assert closed_schema(patterned) == patterned
    nullable = {"type": ["object", "null"], "properties": {"a": {"type": "integer"}}}
    assert closed_schema(nullable)["additionalProperties"] is False
