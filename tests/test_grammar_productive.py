"""The productive-rule check reads xgrammar's printed grammars, and refuses exactly those
whose root derives no finite string."""
from __future__ import annotations

import json

import pytest
import xgrammar
from test_http_structured_output import SCHEMAS

from trillm.engine import grammar_productive
from trillm.engine.grammar_productive import admits_output


def printed(schema: dict) -> str:
    return str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


def readable(text: str) -> bool:
    try:
        grammar_productive._Parser(grammar_productive._tokens(text)).rules()
    except grammar_productive._Unreadable:
        return False
    return True


@pytest.mark.parametrize("text", [
    *(printed(schema) for schema in SCHEMAS),
    str(xgrammar.Grammar.builtin_json_grammar()),
    str(xgrammar.Grammar.from_regex(r"a(b|c)*[0-9]{2,3}\.?")),
    str(xgrammar.Grammar.from_ebnf('root ::= "x" a (= "y")\na ::= a "y" | ("z")*')),
    str(xgrammar.Grammar.from_structural_tag(
        [xgrammar.StructuralTagItem(begin="<f>", schema='{"type": "object"}', end="</f>")], ["<f"])),
])
def test_every_printed_form_is_read_and_a_satisfiable_grammar_admits_output(text):
    assert readable(text), text[:400]
    assert admits_output(text)


@pytest.mark.parametrize("text", [
    printed({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    printed({"$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/b"}, "minItems": 2},
                       "b": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
             "$ref": "#/$defs/a"}),
    str(xgrammar.Grammar.from_ebnf('root ::= "x" a\na ::= a "y" | "[" a "]"')),
    str(xgrammar.Grammar.from_ebnf('root ::= "x" a{1, 3}\na ::= "(" a ")"')),
])
def test_a_grammar_whose_root_never_ends_admits_no_output(text):
    assert readable(text), text[:400]
    assert not admits_output(text)


def test_optional_recursion_admits_output():
    assert admits_output(printed({"type": "object", "properties": {"a": {"$ref": "#"}}}))
    assert admits_output(printed({"type": "array", "items": {"$ref": "#"}}))
    assert admits_output(str(xgrammar.Grammar.from_ebnf('root ::= "x" a{0, 3}\na ::= "(" a ")"')))
