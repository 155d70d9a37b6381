"""The request fields that ask for structured outputs, and the one GuideSpec they give.

    response_format      {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ...}}
                         | {"type": "structural_tag", "format": {...}} (xgrammar's structural tag)
                         | {"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
                            "triggers": [...]} (the older form)
    structured_outputs   vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object" |
                         "structural_tag" (either form above, as JSON text or an object): ...,
                         "disable_any_whitespace": bool}
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older extras

At most one of them may say what the output follows (a 400 names the clash).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hyla.server.errors import UnsupportedParameter
from hyla.server.structured import GuideSpec

MAX_CHOICES_GUIDED = 1024  # guided_choice alternatives


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TagStructure(_Strict):
    """One structure of the older structural-tag form: after `begin`, JSON following `schema`,
    then `end`."""

    begin: str
    schema_: dict | bool = Field(..., alias="schema")
    end: str


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag: xgrammar's format object, or the older structures + triggers
    format: dict[str, Any] | None = None
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None

    def structural_tag(self) -> str:
        """The structural tag as JSON text, as vLLM hands it to xgrammar."""
        if self.format is not None:
            if self.structures is not None or self.triggers is not None:
                raise UnsupportedParameter("response_format", "a structural tag has either a format or "
                                           "structures and triggers, not both")
            return json.dumps({"type": "structural_tag", "format": self.format})
        if self.structures is None or self.triggers is None:
            raise UnsupportedParameter("response_format", "response_format structural_tag needs a format (or "
                                       "structures and triggers)")
        structures = [{"begin": t.begin, "schema": t.schema_, "end": t.end} for t in self.structures]
        return json.dumps({"type": "structural_tag", "structures": structures, "triggers": self.triggers})


class StructuredOutputs(_Strict):
    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # there is one backend, so never a fallback: honoured as it is


def _structural_tag(value, param: str) -> str:
    """structured_outputs.structural_tag (JSON text, as vLLM takes it, or the object) -> JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UnsupportedParameter(param, f"{param} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise UnsupportedParameter(param, f"{param} must be a structural tag (an object)")
    return json.dumps(value)


def _schema(value, param: str):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UnsupportedParameter(param, f"{param} is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise UnsupportedParameter(param, f"{param} must be a JSON schema (an object)")
    return value


class StructuredFields(BaseModel):
    """Mixed into the request bodies (their model_config applies)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def guide_spec(self) -> tuple[GuideSpec | None, bool]:
        """-> (what the output must follow or None, any_whitespace for JSON)."""
        found: list[tuple[str, GuideSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", GuideSpec("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise UnsupportedParameter("response_format", "response_format json_schema needs json_schema.schema")
            found.append(("response_format", GuideSpec("json", rf.json_schema.schema_)))
        elif rf is not None and rf.type == "structural_tag":
            found.append(("response_format", GuideSpec("structural_tag", rf.structural_tag())))
        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None:
                schema = _schema(so.json_, "structured_outputs.json")
                found.append(("structured_outputs.json", GuideSpec("json", schema)))
            if so.regex is not None:
                found.append(("structured_outputs.regex", GuideSpec("regex", so.regex)))
            if so.choice is not None:
                found.append(("structured_outputs.choice", GuideSpec("choice", tuple(so.choice))))
            if so.grammar is not None:
                found.append(("structured_outputs.grammar", GuideSpec("grammar", so.grammar)))
            if so.json_object:
                found.append(("structured_outputs.json_object", GuideSpec("json_object")))
            if so.structural_tag is not None:
                tag = _structural_tag(so.structural_tag, "structured_outputs.structural_tag")
                found.append(("structured_outputs.structural_tag", GuideSpec("structural_tag", tag)))
        if self.guided_json is not None:
            found.append(("guided_json", GuideSpec("json", _schema(self.guided_json, "guided_json"))))
        if self.guided_regex is not None:
            found.append(("guided_regex", GuideSpec("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", GuideSpec("choice", tuple(self.guided_choice))))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", GuideSpec("grammar", self.guided_grammar)))
        if len(found) > 1:
            raise UnsupportedParameter(found[1][0], "give one structured output constraint, got "
                                       + " and ".join(name for name, _ in found))
        any_whitespace = not (so is not None and so.disable_any_whitespace)
        if not found:  # (the whitespace option still applies to forced tool calls)
            return None, any_whitespace
        name, spec = found[0]
        if spec.kind == "choice" and not (0 < len(spec.value) <= MAX_CHOICES_GUIDED and all(spec.value)):
            raise UnsupportedParameter(name, f"{name} needs 1..{MAX_CHOICES_GUIDED} non-empty strings")
        if spec.kind in ("regex", "grammar") and not spec.value:
            raise UnsupportedParameter(name, f"{name} must not be empty")
        return spec, any_whitespace

    def guide_param(self) -> str:
        """The field a compile error is reported against."""
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            if getattr(self, name) is not None:
                return name
        return "structured_outputs"
