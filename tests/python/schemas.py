"""Fifty varied JSON schemas for the structured-output tests: nested objects, arrays with bounds, enums,
numbers with bounds, optional fields, booleans, nullable fields and strings with patterns and lengths.
Deterministic: the same fifty every run."""

import random

NAMES = ["name", "city", "title", "color", "animal", "country", "food", "tool", "planet", "river",
         "author", "brand", "fruit", "sport", "language", "instrument", "metal", "tree", "bird", "ship"]


def _leaf(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["free", "string", "short", "integer", "number", "boolean", "enum", "nullable", "array",
                       "object", "pattern"])
    if depth >= 2 and kind in ("array", "object"):
        kind = "integer"
    if kind == "free":
        return {"type": "string"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 24])}
    if kind == "short":
        return {"type": "string", "minLength": 1, "maxLength": 6}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        lo = rng.randint(0, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + 100}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "north", "south", "yes", "no", "small", "large"], 3)}
    if kind == "nullable":
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[A-Z][a-z]{2,8}$", "^[0-9]{3}-[0-9]{4}$",
                                                          "^(alpha|beta|gamma)$"])}
    if kind == "array":
        return {"type": "array", "items": _leaf(rng, depth + 1), "minItems": rng.randint(0, 2),
                "maxItems": rng.randint(2, 4)}
    return _object(rng, depth + 1, rng.randint(1, 3))


def _object(rng: random.Random, depth: int, fields: int) -> dict:
    keys = rng.sample(NAMES, fields)
    props = {k: _leaf(rng, depth) for k in keys}
    required = [k for k in keys if rng.random() < 0.7] or keys[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(count: int = 50) -> list[dict]:
    rng = random.Random(2026)
    return [_object(rng, 0, rng.randint(1, 4)) for _ in range(count)]
