"""Which cases a run takes: ``-k EXPRESSION`` in pytest's syntax over case ids and feature tags, and
``--match REGEX`` (a regular expression searched in the case id).

An expression is words joined by ``and``, ``or``, ``not`` and parentheses, as pytest's ``-k``. A word
matches a case when it is a substring of the case's id (case-insensitively, as in pytest), or equals one of
its keywords: its feature tags (``last``, ``interior``, ``ubatch``, ``decode``, ...), its kind, its entry
point (``last:embeddings``) and its set's name. As in pytest, a word is also a substring: ``last`` takes
the last-logits cases and the prefill cases whose id holds ``rows-last``; ``-k '/last/ and not embeddings'``
(a piece of the id) or ``-k 'last:plain or last:seq_id'`` (entry points) take the last-logits cases other than
the embeddings entry, ``-k 'e2b-mini and (chunked or ubatch)'`` the chunked and micro-batched prefill cases of
one set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

__all__ = ["CaseFilter", "SelectError", "parse_expression"]

_TOKEN = re.compile(r"\s*(\(|\)|[^\s()]+)")
_OPERATORS = ("and", "or", "not")
_REGEX_SIGNS = re.compile(r"[|^$*?\\{}]")  # characters of a regular expression that no case id holds


class SelectError(ValueError):
    """An expression or a regular expression that cannot be read (a usage error)."""


Predicate = Callable[[set[str], str], bool]  # (keywords, id lower-cased) -> selected


def parse_expression(text: str) -> Predicate:
    """A pytest-style ``-k`` expression as a predicate over a case's keywords and id. SelectError names the
    problem and where it is."""
    tokens = _TOKEN.findall(text)
    if not tokens:
        raise SelectError(f"-k: an empty expression: {text!r}")
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def joined(word: str, operand: Callable[[], Predicate], combine: Callable[[bool, bool], bool]) -> Predicate:
        """``operand (word operand)*``, left to right."""
        left = operand()
        while peek() == word:
            take()
            right, prev = operand(), left

            def left(k, i, a=prev, b=right):
                return combine(a(k, i), b(k, i))
        return left

    def expr() -> Predicate:  # or binds loosest, then and, then not
        return joined("or", and_expr, lambda a, b: a or b)

    def and_expr() -> Predicate:
        return joined("and", not_expr, lambda a, b: a and b)

    def not_expr() -> Predicate:
        if peek() == "not":
            take()
            inner = not_expr()
            return lambda k, i: not inner(k, i)
        if peek() == "(":
            take()
            inner = expr()
            if peek() != ")":
                raise SelectError(f"-k: a '(' without its ')' in {text!r}")
            take()
            return inner
        word = peek()
        if word is None:
            raise SelectError(f"-k: the expression {text!r} ends where a word was expected")
        if word in _OPERATORS or word == ")":
            raise SelectError(f"-k: unexpected {word!r} in {text!r} (a word was expected)")
        take()
        if _REGEX_SIGNS.search(word):
            raise SelectError(f"-k: {word!r} looks like a regular expression; -k takes a pytest-style expression "
                              "(words joined by and, or, not and parentheses): give a regular expression with --match")
        low = word.lower()
        return lambda k, i: low in i or low in k

    predicate = expr()
    if pos != len(tokens):
        raise SelectError(f"-k: unexpected {tokens[pos]!r} in {text!r}; combine words with and, or, not and "
                          "parentheses (a regular expression goes to --match)")
    return predicate


@dataclass(frozen=True)
class CaseFilter:
    """``-k`` and ``--match`` together (a case is taken when both, as given, take it)."""

    expression: str | None = None
    regex: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "_predicate", None if self.expression is None else parse_expression(self.expression))
        try:
            object.__setattr__(self, "_pattern", None if self.regex is None else re.compile(self.regex))
        except re.error as e:
            raise SelectError(f"--match: not a valid regular expression ({e}): {self.regex!r}") from None

    def __call__(self, case, set_name: str = "") -> bool:
        if self._pattern is not None and not self._pattern.search(case.id):
            return False
        if self._predicate is None:
            return True
        keywords = {f.lower() for f in case.features} | {case.kind.lower(), set_name.lower()}
        if case.kind == "last":
            keywords.add(f"last:{case.entry}".lower())
        return self._predicate(keywords, case.id.lower())

    def describe(self) -> str | None:
        """How the report records the selection (None: every case)."""
        parts = ([f"-k {self.expression!r}"] if self.expression is not None else []) + \
                ([f"--match {self.regex!r}"] if self.regex is not None else [])
        return " ".join(parts) or None

    @property
    def empty(self) -> bool:
        return self.expression is None and self.regex is None
