"""Structured output as each API family spells it: OpenAI's response_format and its peers'
extensions, vLLM's structured_outputs; each becomes one StructuredOutput spec."""
from __future__ import annotations

import json
import re
from typing import Any, Literal

import pydantic
from pydantic import Field

from trillm.http import json_body
from trillm.http.protocol.common import MAX_CHOICES, MAX_LIST_ITEMS, Strict
from trillm.sampling_params import SamplingParamError, StructuredOutput


class JSONSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TagStructure(Strict):
    """One tagged region of the older structural-tag form: `begin`, JSON after `schema`, `end`."""

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class ResponseFormat(Strict):
    """OpenAI's text / json_object / json_schema, and the peers' extensions: `regex` and `ebnf`
    (vLLM, SGLang), `json` with `schema` (TensorRT-LLM), `regex_schema` (LMDeploy), and
    `structural_tag`, as xgrammar's `format` (TensorRT-LLM, vLLM) or the older `structures` with
    `triggers` (vLLM, SGLang)."""

    type: Literal["text", "json_object", "json_schema", "json", "regex", "regex_schema", "ebnf", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    regex: str | None = None
    regex_schema: str | None = None
    ebnf: str | None = None
    format: dict[str, Any] | None = None
    structures: list[TagStructure] | None = Field(None, max_length=MAX_LIST_ITEMS)
    triggers: list[str] | None = Field(None, max_length=MAX_LIST_ITEMS)

    def to_structured_output(self, param: str = "response_format") -> StructuredOutput | None:
        """None for plain text. A schema is strict (no property it does not name) unless
        `strict` is false: a small model left free to add properties tends to."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object", param=param)
        if self.type == "structural_tag":
            return self._structural_tag(param)
        field_name = {"json": "schema", "json_schema": "json_schema"}.get(self.type, self.type)
        value = {"json": self.schema_, "json_schema": self.json_schema, "regex": self.regex,
                 "regex_schema": self.regex_schema, "ebnf": self.ebnf}[self.type]
        if not value:
            raise SamplingParamError(
                f"{param}.{field_name}", f"A response_format of type {self.type} needs a non-empty {field_name}."
            )
        if self.type == "json":
            return StructuredOutput.from_schema(value, param=param)
        if self.type == "json_schema":
            return StructuredOutput.from_schema(value.schema_ or {}, strict=value.strict is not False, param=param)
        return StructuredOutput("grammar" if self.type == "ebnf" else "regex", value, param=param)

    def _structural_tag(self, param: str) -> StructuredOutput:
        if self.format is not None:
            tag = {"type": "structural_tag", "format": self.format}
        elif self.structures and self.triggers:
            tag = {"structures": [s.model_dump(by_alias=True) for s in self.structures], "triggers": self.triggers}
        else:
            raise SamplingParamError(param, "A structural_tag needs a format, or structures and triggers.")
        return StructuredOutput("structural_tag", json.dumps(tag), param=param)


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of these. `structural_tag` is a response_format of
    type structural_tag, as JSON text."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


def choice_spec(choices: list[str], param: str) -> StructuredOutput:
    """The output is one of `choices`, exactly: a regex of their literal alternatives."""
    return StructuredOutput("regex", "|".join(f"({re.escape(c)})" for c in choices), param=param)


def schema_spec(value: str | dict, param: str) -> StructuredOutput:
    """A JSON schema sent as an object or as JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json_body.loads(value)
        except json_body.JSONError as exc:
            raise SamplingParamError(param, f"{param} cannot be read: {exc}") from None
    if not isinstance(value, dict):
        raise SamplingParamError(param, f"{param} must be a JSON schema object.")
    return StructuredOutput.from_schema(value, param=param)


def structural_tag_spec(text: str, param: str) -> StructuredOutput:
    try:
        tag = ResponseFormat.model_validate_json(text)
    except pydantic.ValidationError as exc:
        raise SamplingParamError(param, f"{param} is not a valid structural tag: {exc.errors()[0]['msg']}") from None
    if tag.type != "structural_tag":
        raise SamplingParamError(param, f"{param} must have type structural_tag.")
    return tag.to_structured_output(param)
