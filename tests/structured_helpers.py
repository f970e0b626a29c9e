"""Schemas and a small JSON-schema checker shared by the structured-output tests.

The checker covers the keywords the test schemas use (type, enum, properties, required,
additionalProperties, items, min/maxItems, min/maxLength, pattern, minimum/maximum); it is written
here so the tests do not depend on the grammar library to judge its own output.
"""

from __future__ import annotations

import re
from typing import Any

# Nested object, enum, array, bounded strings: non-trivial, and finite for a random tiny model.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def schema_errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Every violation of ``schema`` by ``value`` (empty when valid)."""
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    kind = schema.get("type")
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [*errors, f"{path}: {value!r} is not an integer"]
    elif kind == "number":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return [*errors, f"{path}: {value!r} is not a number"]
    elif kind is not None and not isinstance(value, _TYPES[kind]):
        return [*errors, f"{path}: {value!r} is not of type {kind}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", 1 << 30):
            errors.append(f"{path}: length {len(value)} outside the bounds")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        for key, item in value.items():
            if key in props:
                errors += schema_errors(item, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path}: unexpected key {key!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", 1 << 30):
            errors.append(f"{path}: {len(value)} items outside the bounds")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{path}[{i}]")
    return errors
