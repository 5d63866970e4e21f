"""Errors raised for bad input. Each message names what is wrong and how to fix it.

The command-line tools print these messages (never a traceback) and exit with status 2.
"""


class RefimplError(Exception):
    """Base class of every error the oracle raises for bad input."""


class ConfigError(RefimplError):
    """config.json is missing, malformed or inconsistent."""


class WeightsError(RefimplError):
    """A safetensors file or tensor is missing, corrupt, truncated or mis-shaped."""


class TokenizerError(RefimplError):
    """The tokenizer is missing or cannot encode or decode what was asked."""


class InputError(RefimplError):
    """Token ids, rows or other call arguments are out of range."""


class NonFiniteError(RefimplError):
    """The forward produced NaN or inf: the message names the first place (embedding, layer, logits)
    and the weight tensor that is not finite there, or says that the values overflowed."""


class ChatTemplateError(RefimplError):
    """The checkpoint's chat template is malformed, fails to render, or raises (``raise_exception``)."""


class ContextLimitError(InputError):
    """A prompt (or a prompt and the tokens to be generated after it) is longer than the checkpoint's context,
    ``max_position_embeddings``; ``--allow-beyond-context`` runs it anyway."""


def choice_message(name: str, value, choices, *, who: str = "", hint: str = "") -> str:
    """The one message every option's bad value gets: ``"<who>: <name> must be one of a, b, c<hint>, got 'x'"``
    (``who``, the component, when given; ``hint``, more allowed forms, e.g. " (or cuda:N)")."""
    where = f"{who}: " if who else ""
    return f"{where}{name} must be one of {', '.join(str(c) for c in choices)}{hint}, got {value!r}"


def check_choice(name: str, value, choices, *, who: str = "", error: type[Exception] = InputError,
                 hint: str = ""):
    """``value`` when it is one of ``choices``; otherwise ``error(choice_message(...))``."""
    if value in choices:
        return value
    raise error(choice_message(name, value, choices, who=who, hint=hint))
