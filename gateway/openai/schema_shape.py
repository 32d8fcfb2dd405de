"""The shape of a request's JSON schemas, bounded before anything reads them whole.

Checking a schema against its metaschema costs time in proportion to the objects in it, each a
subschema it may descend into, and stack in proportion to its nesting, not in proportion to its
bytes: with the pure-Python checker, 3,500 properties in a 228 KB body held the event loop for
over a second, and a schema nested 900 deep raised RecursionError (a 500). So the
request's schemas together (``response_format``'s, the ``json_schema`` field's, every tool's
``parameters``) are walked once, without recursion, before validation, and refused past any
bound below. The walk stops at the first bound crossed, so it costs at most the bounds.

The bounds are far above what real schemas use: OpenAI's structured outputs take at most 5,000
properties and 10 levels of object nesting per schema (100 and 5 in strict mode's first
release); an object level is two to five JSON levels (``properties``, the property, ``items``,
``anyOf`` and its list). Counts are generous by construction: a property named like a keyword
(``"pattern"``) counts as one too, which only errs towards the work the check really does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemaLimits:
    # Nesting of JSON objects and arrays: the metaschema check and the engine's grammar compiler
    # both descend it recursively.
    depth: int = 64
    # JSON objects and arrays, all schemas of the request together: what the check's time goes
    # by (a property's schema is one object, an ``anyOf`` one array and an object per branch).
    containers: int = 5_000
    # JSON values of every kind (the schemas' size): what the walk itself goes by.
    values: int = 50_000
    # Entries of ``properties`` maps, all schemas together.
    properties: int = 1_000
    # ``pattern`` keywords and ``patternProperties`` entries: each is a regular expression the
    # check compiles and the engine's grammar compiler turns into a grammar.
    patterns: int = 100


SCHEMA_LIMITS = SchemaLimits()


@dataclass(frozen=True, slots=True)
class ShapeError:
    param: str  # the schema where a bound was crossed
    message: str


def schema_shape_error(
    schemas: Iterable[tuple[str, Any]], limits: SchemaLimits = SCHEMA_LIMITS
) -> ShapeError | None:
    """The first bound the schemas (``(param, schema)`` pairs) cross together; None if none."""
    containers = values = properties = patterns = 0
    for param, schema in schemas:
        if not isinstance(schema, dict | list):
            continue  # not a schema at all: validation says so
        stack: list[tuple[Any, int]] = [(schema, 1)]
        while stack:
            value, depth = stack.pop()
            if depth > limits.depth:
                return ShapeError(param, f"JSON schemas may nest at most {limits.depth} levels.")
            containers += 1
            values += len(value)
            if containers > limits.containers or values > limits.values:
                return ShapeError(
                    param,
                    f"JSON schemas may hold at most {limits.containers} objects and arrays and "
                    f"{limits.values} values per request.",
                )
            children: Iterable[Any] = value
            if isinstance(value, dict):
                declared = value.get("properties")
                if isinstance(declared, dict):
                    properties += len(declared)
                    if properties > limits.properties:
                        return ShapeError(
                            param,
                            f"JSON schemas may declare at most {limits.properties} properties "
                            "per request.",
                        )
                by_pattern = value.get("patternProperties")
                patterns += isinstance(value.get("pattern"), str)
                patterns += len(by_pattern) if isinstance(by_pattern, dict) else 0
                if patterns > limits.patterns:
                    return ShapeError(
                        param,
                        f"JSON schemas may hold at most {limits.patterns} patterns per request.",
                    )
                children = value.values()
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return None
