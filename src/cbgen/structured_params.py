"""What a constrained request asks for: ``SamplingParams(structured_output=...)``.

The shape follows vLLM's ``StructuredOutputsParams`` so that code moves between the engines without
renaming: exactly one of ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of a list of strings) or ``grammar`` (a Lark grammar).  Only the shape is checked
here; whether a schema or grammar compiles needs the tokenizer, so :meth:`cbgen.engine.Engine.validate`
compiles it before anything is queued.  A leaf module: ``sampling_params`` imports it, and ``core``
imports that.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputParams:
    """One output constraint; set exactly one field.

    * ``json``: a JSON schema, as a dict or a JSON string; the output is one JSON value valid
      against it.
    * ``json_object``: ``True`` for any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
    * ``regex``: the whole output matches this regular expression (Rust ``regex`` syntax, anchored).
    * ``choice``: the output is exactly one of these strings.
    * ``grammar``: a Lark grammar (``start`` is the entry rule), in the dialect of the backend
      (llguidance's Lark, which also takes ``%json`` schemas and ``/regex/`` terminals).

    Generation ends with an EOS token once the constraint is satisfied: when the constraint can take
    no further token, EOS is the only token allowed.  Frozen, so one instance can be shared by many
    requests and used as a cache key (:meth:`key`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in _KINDS if _is_set(getattr(self, name))]
        if len(set_fields) != 1:
            raise ValueError(
                "SamplingParams.structured_output: set exactly one of json, json_object, regex, choice, "
                f"grammar (got {set_fields or 'none'})"
            )
        kind = set_fields[0]
        if kind == "json":
            object.__setattr__(self, "json", _checked_schema(self.json))
        elif kind == "json_object" and self.json_object is not True:
            raise ValueError("SamplingParams.structured_output.json_object must be True or False")
        elif kind in ("regex", "grammar") and (
            not isinstance(getattr(self, kind), str) or not getattr(self, kind)
        ):
            raise ValueError(f"SamplingParams.structured_output.{kind} must be a non-empty string")
        elif kind == "choice":
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
                raise ValueError(
                    "SamplingParams.structured_output.choice must be a non-empty list of strings"
                )
            if not all(isinstance(c, str) and c for c in choice):
                raise ValueError("SamplingParams.structured_output.choice must hold non-empty strings")
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(name for name in _KINDS if _is_set(getattr(self, name)))

    def key(self) -> str:
        """A canonical string naming the constraint: equal constraints share one compiled grammar."""
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = _json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            value = _json.dumps(list(value))
        return f"{kind}:{value}"

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputParams | None:
        """``value`` as a :class:`StructuredOutputParams`: an instance as it is, a dict as keyword
        arguments (``{"json": schema}``, ``{"regex": "..."}``), None as None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(
                    f"SamplingParams.structured_output: unknown field(s) {unknown}; expected one of {list(_KINDS)}"
                )
            return cls(**value)
        raise ValueError(
            "SamplingParams.structured_output must be a StructuredOutputParams, a dict such as "
            f'{{"json": schema}}, or None (got {type(value).__name__})'
        )


def _is_set(value: Any) -> bool:
    return value is not None and value is not False


def _checked_schema(schema: Any) -> dict[str, Any] | str:
    """A JSON schema must be an object (or a JSON string holding one); ``true`` means any value."""
    parsed = schema
    if isinstance(schema, str):
        try:
            parsed = _json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"SamplingParams.structured_output.json: not valid JSON: {exc}") from None
    if not isinstance(parsed, (dict, bool)):
        raise ValueError(
            "SamplingParams.structured_output.json must be a JSON schema object "
            f"(got {type(parsed).__name__})"
        )
    if isinstance(parsed, dict):
        try:
            _json.dumps(parsed)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"SamplingParams.structured_output.json: not JSON-serialisable: {exc}") from None
    return schema


__all__ = ["StructuredOutputParams"]
