"""A validator for the OpenAPI v3 subset a Kubernetes CRD uses (for tests).

Covers type, format (int32/int64 ranges), required, enum, properties, additionalProperties,
items, anyOf, pattern. An object schema that lists properties rejects others: the API server
would prune them silently, which is an error for a manifest we generate.
"""

from __future__ import annotations

import re
from typing import Any

_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}


def validate(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every violation of `schema` by `value`, as 'path: reason' lines (empty when valid)."""
    errors: list[str] = []
    where = path or "<root>"
    if "anyOf" in schema and all(validate(value, alt, path) for alt in schema["anyOf"]):
        return [f"{where}: matches none of {[alt.get('type') for alt in schema['anyOf']]}"]
    kind = schema.get("type")
    if kind is not None:
        if not _TYPES[kind](value):
            return [f"{where}: expected {kind}, got {type(value).__name__} {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if "format" in schema and isinstance(value, int) and schema["format"] in _INT_RANGE:
        lo, hi = _INT_RANGE[schema["format"]]
        if not lo <= value <= hi:
            errors.append(f"{where}: {value} is outside {schema['format']}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{where}: missing required field {name!r}")
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = f"{path}.{key}" if path else key
            if props is not None and key in props:
                errors += validate(item, props[key], sub)
            elif isinstance(extra, dict):
                errors += validate(item, extra, sub)
            elif props is not None or extra is False:
                errors.append(f"{sub}: unknown field (the API server would drop it)")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors
