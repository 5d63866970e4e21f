"""Old import path of the fixture-set API, kept for code written against it (docs/architecture.md,
"Migration"): reading sets is ``conformance.sets``, writing them ``conformance.generate``.

    from conformance.fixtures import generate_set, load_set, verify_set, bundled_sets   # still works
"""

from .generate import (
    CONSISTENCY_BOUND,
    RECOMPUTE_BOUND,
    PartialRunBusy,
    PartialRunMismatch,
    PromptError,
    generate_set,
    has_audio_tower,
    has_vision_tower,
    load_prompts,
    synthetic_image,
    synthetic_waveform,
    verify_set,
)
from .sets import CASES, EXPECTED, MANIFEST, FixtureError, FixtureSet, bundled_set, bundled_sets, load_set, sha256_file

__all__ = ["CASES", "CONSISTENCY_BOUND", "EXPECTED", "MANIFEST", "RECOMPUTE_BOUND", "FixtureError", "FixtureSet",
           "PartialRunBusy", "PartialRunMismatch", "PromptError", "bundled_set", "bundled_sets", "generate_set",
           "has_audio_tower", "has_vision_tower", "load_prompts", "load_set", "sha256_file", "synthetic_image",
           "synthetic_waveform", "verify_set"]
