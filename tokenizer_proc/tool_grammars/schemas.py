"""The JSON schemas of forced calls: a tool's parameters, numbers that JSON carries back, and
the parameters one by one for formats that write each apart (qwen3_coder, pythonic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest

# NOTE: keywords that say nothing about which values are valid
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly"}
    | {"$comment", "$schema", "$id"}
)
# NOTE: keywords whose values are data, not schemas (never walked into)
_DATA = ANNOTATIONS | {"enum", "const"}
# NOTE: keywords whose values map names to schemas
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# NOTE: what an object of named parameters may say besides annotations
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties"})
DEFS = ("$defs", "definitions")

# NOTE: a number without bounds may take an exponent, and Python reads `1e400` as inf, which
# JSON cannot carry back (json.dumps wrote `Infinity`); bounded, llguidance writes plain
# decimals. 1e15: its float-range regexes fail from about 1e16 on.
NUMBER_BOUND = 1e15


def parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (an object: a call's arguments are one)."""
    params = function.get("parameters") or {"type": "object"}
    if not isinstance(params, dict):
        raise InvalidRequest("tools", f"{function['name']}: parameters must be a JSON schema")
    return params if "type" in params else {**params, "type": "object"}


def call_schema(function: dict[str, Any], key: str) -> dict[str, Any]:
    """`{"name": <the tool's>, key: <its parameters>}`, as JSON forms of a call write it."""
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, key: finite(parameters(function))},
        "required": ["name", key],
        "additionalProperties": False,
    }


def finite(schema: Any) -> Any:
    """`schema` with every number held within bounds (NUMBER_BOUND where it gives none)."""
    if isinstance(schema, list):
        return [finite(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, dict):
            out[key] = {name: finite(s) for name, s in value.items()}
        else:
            out[key] = value if key in _DATA else finite(value)
    return _bounded(out) if "number" in types_of(out) else out


def within_lengths(text: str, schema: dict[str, Any]) -> bool:
    """Whether `text` is within the string schema's `minLength` / `maxLength`."""
    longest = schema.get("maxLength")
    return schema.get("minLength", 0) <= len(text) and (longest is None or len(text) <= longest)


def types_of(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else {t for t in kind or () if isinstance(t, str)}


def _bounded(schema: dict[str, Any]) -> dict[str, Any]:
    low = _number(schema.get("minimum", schema.get("exclusiveMinimum")))
    high = _number(schema.get("maximum", schema.get("exclusiveMaximum")))
    if low is None:
        schema["minimum"] = -NUMBER_BOUND if high is None else min(-NUMBER_BOUND, high)
    if high is None:
        schema["maximum"] = NUMBER_BOUND if low is None else max(NUMBER_BOUND, low)
    return schema


def _number(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Param:
    """One named parameter: its schema (numbers bounded, the root's definitions carried along,
    so that it stands alone) and whether a call must give it."""

    name: str
    schema: Any
    required: bool


def named_params(function: dict[str, Any]) -> list[Param] | None:
    """A tool's parameters one by one, in their schema's order; None where its schema says more
    than an object of named properties does (a format writing them one by one cannot hold a
    call to it: `anyOf` over the object, `minProperties`, a required name without a property)."""
    params = parameters(function)
    if set(params) - ANNOTATIONS - _OBJECT_KEYS - set(DEFS) or params.get("type") != "object":
        return None
    props, required = params.get("properties", {}), params.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        return None
    if not set(required) <= set(props) or not _local_refs(params):
        return None
    defs = {key: finite(params[key]) for key in DEFS if key in params}
    return [Param(n, _with_defs(finite(s), defs), n in required) for n, s in props.items()]


def _with_defs(schema: Any, defs: dict[str, Any]) -> Any:
    """A parameter's schema with its root's definitions, so its `$ref`s resolve on their own."""
    if not isinstance(schema, dict) or not defs:
        return schema
    return {**schema, **{k: {**v, **schema.get(k, {})} for k, v in defs.items()}}


def _local_refs(schema: Any) -> bool:
    """Whether every `$ref` names a definition (`#/$defs/..`): a parameter's schema, cut from
    its root, can still resolve those, not `#` or `#/properties/..`."""
    if isinstance(schema, list):
        return all(_local_refs(s) for s in schema)
    if not isinstance(schema, dict):
        return True
    ref = schema.get("$ref")
    if ref is not None and not (
        isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/"))
    ):
        return False
    return all(_local_refs(v) for k, v in schema.items() if k not in _DATA)


# NOTE: what a string's schema may hold and still be written as raw text
STRING_KEYS = frozenset({"minLength", "maxLength", "enum", "const"})


def is_text(schema: dict[str, Any]) -> bool:
    """Whether a value is written raw: a string, or an enum of strings, held to nothing raw
    text cannot be (a pattern, a format: those are JSON)."""
    if set(schema) - ANNOTATIONS - set(DEFS) - {"type"} - STRING_KEYS:
        return False
    if "type" in schema:
        return types_of(schema) == {"string"}
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else []
    return bool(values) and isinstance(values, list) and all(isinstance(v, str) for v in values)
