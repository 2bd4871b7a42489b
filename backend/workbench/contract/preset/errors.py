"""Preset errors: ``PresetError`` (every problem as ``JSON.path: found <value>, expected
<what>``) and ``field_error`` / ``field_errors`` for rules between fields, located at the field."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError


class PresetError(ValueError):
    """A preset is invalid; ``problems`` holds ``{path, found, expected, message}`` per problem
    (``message``: ``found <value>, expected <what>``, or the sentence of a rule between fields)."""

    def __init__(self, problems: list[dict[str, Any]]) -> None:
        for p in problems:
            p.setdefault("message", f"found {p['found']}, expected {p['expected']}")
        self.problems = problems
        lines = [f"{p['path']}: {p['message']}" for p in problems]
        super().__init__("invalid preset:\n  " + "\n  ".join(lines))


def field_error(model: str, field: str, value: Any, sentence: str) -> ValidationError:
    """A ``ValidationError`` located at ``field`` for a rule between fields.

    Raised from a model validator, it is reported at ``<model's path>.<field>`` with ``sentence``
    as its message (a plain ``ValueError`` there is reported at the model; see
    NOTE [ Cross-field errors ]).
    """
    return field_errors(model, [(field, value, sentence)])


def field_errors(model: str, problems: list[tuple[str, Any, str]]) -> ValidationError:
    """``field_error`` for several rules at once: one line per ``(field, value, sentence)``, so
    that a model validator reports every rule broken, not only the first it checks."""
    lines = [
        InitErrorDetails(
            type=PydanticCustomError("cross_field", "{sentence}", {"sentence": sentence}),
            loc=(field,),
            input=value,
        )
        for field, value, sentence in problems
    ]
    return ValidationError.from_exception_data(model, lines)


def found_text(value: Any) -> str:
    """``value`` as a problem's ``found``: JSON (a string in quotes), cut to 80 characters."""
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
