"""Twenty JSON Schemas of different shapes, each with a prompt asking for such data, for the
structured-output tests on the real model (tests/output/test_constraints.py)."""

S = {"type": "string", "maxLength": 40}


def obj(properties: dict, required=None, **more) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **more,
    }


CASES = [
    ("a person", obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    (
        "a city",
        obj({"city": S, "country": S, "population": {"type": "integer", "minimum": 0}}),
    ),
    (
        "a shop's opening",
        obj({"is_open": {"type": "boolean"}, "hours": {"type": "integer", "maximum": 24}}),
    ),
    ("a colour", obj({"color": {"enum": ["red", "green", "blue"]}})),
    (
        "some fruits",
        obj({"fruits": {"type": "array", "items": S, "minItems": 2, "maxItems": 4}}),
    ),
    (
        "a book",
        obj(
            {
                "book": obj({"title": S, "author": obj({"first": S, "last": S})}),
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
            }
        ),
    ),
    (
        "the weather",
        obj(
            {
                "temperature": {"type": "number", "minimum": -50, "maximum": 60},
                "unit": {"enum": ["C", "F"]},
            }
        ),
    ),
    (
        "a film",
        obj(
            {"title": S, "subtitle": S, "minutes": {"type": "integer", "minimum": 1}},
            required=["title"],
        ),
    ),
    ("a US zip code", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    (
        "the steps of making tea",
        obj(
            {
                "steps": {
                    "type": "array",
                    "items": obj(
                        {"n": {"type": "integer", "minimum": 1, "maximum": 10}, "text": S}
                    ),
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
    ),
    ("a date", obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    (
        "an HTTP status",
        obj(
            {
                "status": {"enum": ["ok", "error"]},
                "code": {"type": "integer", "minimum": 100, "maximum": 599},
            }
        ),
    ),
    (
        "test scores",
        obj(
            {
                "scores": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 100},
                    "minItems": 3,
                    "maxItems": 5,
                }
            }
        ),
    ),
    (
        "an email address",
        obj({"email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}}),
    ),
    (
        "a 2x2 matrix",
        obj(
            {
                "matrix": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                }
            }
        ),
    ),
    (
        "a value",
        obj({"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}}),
    ),
    ("three animals", {"type": "array", "items": S, "minItems": 1, "maxItems": 3}),
    (
        "a user",
        obj({"name": S, "nickname": {"type": ["string", "null"], "maxLength": 10}}),
    ),
    (
        "a recipe",
        obj(
            {
                "dish": S,
                "ingredients": {"type": "array", "items": S, "minItems": 2, "maxItems": 5},
                "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
            }
        ),
    ),
    (
        "a colour in RGB",
        obj({c: {"type": "integer", "minimum": 0, "maximum": 255} for c in "rgb"}),
    ),
]


def prompt(what: str, schema: dict) -> str:
    import json

    return (
        f"Describe {what} as JSON matching this JSON Schema: {json.dumps(schema)}. "
        "Answer with the JSON only."
    )
