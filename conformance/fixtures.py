"""Old import path of the fixture-set API, kept for code written against it (docs/architecture.md,
"Migration"): reading sets is ``conformance.sets``, writing them ``conformance.generate``.

    from conformance.fixtures import generate_set, load_set, verify_set, bundled_sets   # still works
"""

from .generate import (  # noqa: F401
    CONSISTENCY_BOUND, RECOMPUTE_BOUND, PartialRunBusy, PartialRunMismatch, PromptError, generate_set,
    has_audio_tower, has_vision_tower, load_prompts, synthetic_image, synthetic_waveform, verify_set,
)
from .sets import (  # noqa: F401
    CASES, EXPECTED, MANIFEST, FixtureError, FixtureSet, bundled_set, bundled_sets, load_set, sha256_file,
)
