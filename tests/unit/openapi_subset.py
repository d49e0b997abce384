"""A validator for the part of OpenAPI v3 that Kubernetes CRD schemas use, enough to check
a manifest the way the API server's strict field validation would (``kubectl apply
--validate=strict``): types, unknown and required fields, lists, maps, patterns, integer
formats and int-or-string. Not checked: CEL rules (``x-kubernetes-validations``), list-map
key uniqueness, defaults. (jsonschema is not in the test environment, and CRD schemas
carry Kubernetes' own ``x-kubernetes-*`` keys besides.)

``trim`` cuts a CRD's schema down to what one manifest reaches, so that the part it is
checked against can be kept in the repository (the full CRD is ~600 KB): every field
name of each object the manifest uses stays, with its type, so a misspelt or misplaced
field still fails.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

_TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,),
                                       "integer": (int,), "number": (int, float),
                                       "boolean": (bool,)}
_FORMATS = {"int32": 2 ** 31, "int64": 2 ** 63}
# Kept for the fields a manifest does not use: enough to reject a value of the wrong kind.
_KIND_KEYS = ("type", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields")


def errors(schema: dict, value: Any, path: str = "") -> list[str]:
    """Every way ``value`` breaks ``schema``, as "path: what" lines; [] if none."""
    where = path or "<root>"
    if "anyOf" in schema and not any(not errors(s, value, path) for s in schema["anyOf"]):
        return [f"{where}: matches none of {[s.get('type') for s in schema['anyOf']]}"]
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return [f"{where}: {value!r} is neither an integer nor a string"]
    elif "type" in schema:
        kinds = _TYPES[schema["type"]]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            return [f"{where}: {value!r} is not of type {schema['type']}"]
    found: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        found.append(f"{where}: {value!r} does not match {schema['pattern']}")
    limit = _FORMATS.get(schema.get("format", ""))
    if limit and isinstance(value, int) and not -limit <= value < limit:
        found.append(f"{where}: {value} is out of {schema['format']} range")
    if isinstance(value, dict):
        found += _object_errors(schema, value, path)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += errors(schema["items"], item, f"{path}[{i}]")
    return found


def _object_errors(schema: dict, value: dict, path: str) -> list[str]:
    found = [f"{path or '<root>'}: missing required field {name!r}"
             for name in schema.get("required", []) if name not in value]
    properties, extra = schema.get("properties"), schema.get("additionalProperties")
    for name, item in value.items():
        here = f"{path}.{name}" if path else name
        if properties is not None and name in properties:
            found += errors(properties[name], item, here)
        elif isinstance(extra, dict):
            found += errors(extra, item, here)
        elif properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
            found.append(f"{here}: unknown field")     # no properties at all: open (metadata)
    return found


def trim(schema: dict, used: Sequence[Any]) -> dict:
    """The part of ``schema`` that the values ``used`` reach (all of them at this place)."""
    kept = {k: v for k, v in schema.items() if k not in ("description", "properties", "items",
                                                         "additionalProperties", "anyOf")}
    if "anyOf" in schema:
        kept["anyOf"] = [trim(s, used) for s in schema["anyOf"]]
    maps = [u for u in used if isinstance(u, dict)]
    if "properties" in schema:
        kept["properties"] = {
            name: (trim(sub, [m[name] for m in maps if name in m])
                   if any(name in m for m in maps) else
                   {k: sub[k] for k in _KIND_KEYS if k in sub})
            for name, sub in schema["properties"].items()}
    if isinstance(schema.get("additionalProperties"), dict):
        kept["additionalProperties"] = trim(schema["additionalProperties"],
                                            [v for m in maps for v in m.values()])
    if "items" in schema:
        kept["items"] = trim(schema["items"],
                             [i for u in used if isinstance(u, list) for i in u])
    return kept
