"""Whether a grammar admits any finite output: the productive-rule check of its EBNF.

A schema can compile and still admit nothing: `{"properties": {"a": {"$ref": "#"}},
"required": ["a"]}` asks for an object inside an object without end. A matcher then lets
every token through that goes one level deeper, and a request runs to its length limit
without ever holding valid JSON. The classic fixpoint finds such grammars: a rule is
productive once one of its alternatives is made only of terminals, productive rules, and
repetitions that may repeat zero times; the grammar admits an output when its root is.

The input is xgrammar's printed form of a grammar (`str(Grammar)`), which writes every rule
as `name ::= body` with strings, character classes, rule names, groups, `|`, `*`, `+`, `?`,
`{m, n}`, lookaheads `(= ...)`, and calls such as TagDispatch(...) (free text between tags)
or Regex(...), each taken as admitting an output.
Anything else makes `admits_output` answer True: the check refuses only what it can prove.
"""
from __future__ import annotations

import re

_TOKEN = re.compile(r'''
    (?P<space>\s+)
  | (?P<string>"(?:\\.|[^"\\])*")
  | (?P<cls>\[(?:\\.|[^\]\\])*\])
  | (?P<define>::=)
  | (?P<call>[A-Z][A-Za-z]*\()
  | (?P<lookahead>\(=)
  | (?P<repeat>\{\s*\d+\s*(?:,\s*-?\d+\s*)?\})
  | (?P<name>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<op>[()|*+?,=])
''', re.VERBOSE)


class _Unreadable(Exception):
    """The text is not in the form this module reads."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            raise _Unreadable(at)
        at = match.end()
        if match.lastgroup != "space":
            out.append((match.lastgroup, match.group()))
    return out


class _Parser:
    """Recursive descent over the tokens. A body is a list of alternatives, an alternative a
    list of items; an item is True (a terminal, or something that may be empty), a rule's name,
    or a nested body."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens = tokens
        self.at = 0

    def peek(self, offset: int = 0) -> tuple[str, str]:
        i = self.at + offset
        return self.tokens[i] if i < len(self.tokens) else ("end", "")

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if value is not None and token[1] != value:
            raise _Unreadable(self.at)
        self.at += 1
        return token

    def rules(self) -> dict[str, list]:
        rules = {}
        while self.peek()[0] != "end":
            kind, name = self.take()
            if kind != "name" or self.take()[0] != "define":
                raise _Unreadable(self.at)
            rules[name] = self.body()
        return rules

    def starts_rule(self) -> bool:
        return self.peek()[0] == "name" and self.peek(1)[0] == "define"

    def body(self) -> list:
        alternatives = [self.alternative()]
        while self.peek()[1] == "|":
            self.take()
            alternatives.append(self.alternative())
        return alternatives

    def alternative(self) -> list:
        items = []
        while True:
            kind, value = self.peek()
            if kind == "end" or value in ("|", ")") or self.starts_rule():
                return items
            if kind == "lookahead":  # asserts what follows, consumes nothing
                self.take()
                self.body()
                self.take(")")
                continue
            items.append(self.item())

    def item(self):
        kind, value = self.take()
        if kind in ("string", "cls"):
            item = True
        elif kind == "call":
            self.skip_call()
            item = True
        elif kind == "name":
            item = value
        elif value == "(":
            item = self.body()
            self.take(")")
        else:
            raise _Unreadable(self.at)
        while True:
            kind, value = self.peek()
            if value in ("*", "?"):
                item = True
            elif kind == "repeat":
                if int(value.strip("{}").split(",")[0]) == 0:
                    item = True
            elif value != "+":
                return item
            self.take()

    def skip_call(self) -> None:
        depth = 1
        while True:
            kind, value = self.take()
            if kind == "end":
                raise _Unreadable(self.at)
            depth += value == "(" or kind in ("lookahead", "call")
            depth -= value == ")"
            if depth == 0:
                return


def admits_output(grammar_text: str, root: str = "root") -> bool:
    """Whether the grammar printed as `grammar_text` derives at least one finite string from
    `root` (True also when the text is not in the form read here)."""
    try:
        rules = _Parser(_tokens(grammar_text)).rules()
    except _Unreadable:
        return True
    if root not in rules:
        return True
    productive: set[str] = set()

    def holds(item) -> bool:
        if item is True:
            return True
        if isinstance(item, str):
            return item in productive
        return any(all(holds(i) for i in alternative) for alternative in item)

    changed = True
    while changed:
        changed = False
        for name, body in reversed(rules.items()):  # rules mostly name later ones: few passes
            if name not in productive and holds(body):
                productive.add(name)
                changed = True
    return root in productive
