"""One way to say "must be one of" (refimpl.errors.check_choice / choice_message): the message names the option,
the choices and the value; every option check of the oracle and the gate goes through it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from refimpl.errors import InputError, check_choice, choice_message

REPO = Path(__file__).resolve().parents[2]


def test_the_message_names_the_option_the_choices_and_the_value():
    assert check_choice("store", "hidden", ("hidden", "logits")) == "hidden"
    with pytest.raises(InputError) as e:
        check_choice("store", "half", ("hidden", "logits"))
    assert str(e.value) == "store must be one of hidden, logits, got 'half'"
    with pytest.raises(ValueError) as v:
        check_choice("device", "tpu", ("auto", "cpu"), who="transformers backend", error=ValueError,
                     hint=" (or cuda:N)")
    assert str(v.value) == "transformers backend: device must be one of auto, cpu (or cuda:N), got 'tpu'"
    assert choice_message("k", 3, {"a": 1, "b": 2}, who="w") == "w: k must be one of a, b, got 3"


def test_no_option_check_is_hand_written():
    """Outside the helper, "must be one of" stays only in messages that say more than a choice (a list entry, the
    image budgets with their reason, a logits tensor's dtype) and in the problem lists of fixture sets that
    already name their entry."""
    allowed = {"refimpl/errors.py", "refimpl/image.py", "refimpl/config.py", "conformance/protocol/wire.py"}
    found = {str(p.relative_to(REPO)) for root in ("refimpl", "conformance") for p in (REPO / root).rglob("*.py")
             if re.search(r"must be one of", p.read_text(encoding="utf-8"))}
    assert found <= allowed, found - allowed
