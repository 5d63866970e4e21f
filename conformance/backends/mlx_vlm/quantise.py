"""mlx-vlm's quantiser as ``mlx_vlm.convert -q`` runs it, for the mlx-vlm backend's ``quantize`` option and for
the tests' quantised checkpoints (tests/mlx_convert.py).

``mlx_vlm.convert`` quantises with ``mlx_vlm.quant_utils.quantize_model`` and its ``base_quant_predicate``:
every module under a multimodal name (``skip_multimodal_module``: the towers and their embedders) stays as it
is, the rest go through the model's own ``quant_predicate`` (Gemma 4: the MoE router at 8 bits, group size
64; every other linear and embedding at the bits and group size asked). ``--quant-predicate mixed_X_Y``
replaces that predicate with mlx-vlm's mixed recipe, which quantises at group size 64 whatever ``-q-group-size``
says (X bits, Y bits for the first and last eighth of the layers' ``v_proj`` / ``down_proj``, every third in
between, and the embeddings).
"""

from __future__ import annotations

import contextlib
import io

from mlx_vlm.convert import mixed_quant_predicate_builder
from mlx_vlm.quant_utils import quantize_model
from mlx_vlm.utils import skip_multimodal_module

__all__ = ["RECIPES", "quantize_option", "quantized"]

RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_5", "mixed_3_6", "mixed_3_8", "mixed_4_6", "mixed_4_8")
BITS = ("2", "3", "4", "5", "6", "8")
RECIPE_GROUP = 64  # mlx_vlm.convert's mixed recipes quantise at this group size only


def quantize_option(value: str, who: str = "mlx-vlm backend") -> tuple[int | str, int]:
    """(bits or a mixed recipe's name, group size) of a ``"<bits>:<group size>"`` option; ValueError, one line,
    when malformed."""
    what, _, group = str(value).partition(":")
    ok = group.isdigit() and int(group) in (32, 64, 128) and (what in RECIPES or what in BITS)
    if not ok or (what in RECIPES and int(group) != RECIPE_GROUP):
        raise ValueError(f"{who}: option quantize must be '<bits>:<group size>' (bits 2, 3, 4, 5, 6 or 8 with group "
                         f"size 32, 64 or 128, or one of {', '.join(RECIPES)} with group size {RECIPE_GROUP}, the "
                         f"only one mlx-vlm's recipes use), got {value!r}")
    return (what if what in RECIPES else int(what)), int(group)


def quantized(model, raw: dict, what: int | str, group: int) -> tuple[object, dict]:
    """(``model`` quantised as ``mlx_vlm.convert -q`` quantises it, the config.json it would write: ``raw`` with
    the ``quantization`` and ``quantization_config`` blocks)."""
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):  # mlx_vlm.convert's base_quant_predicate
        if skip_multimodal_module(path):
            return False
        return own(path, module) if own is not None else True

    if isinstance(what, str):
        predicate, bits = mixed_quant_predicate_builder(what, model), None
    else:
        bits = what
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
        return quantize_model(model, dict(raw), group, bits, quant_predicate=predicate)
