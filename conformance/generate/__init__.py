"""Writing fixture sets with the oracle: prompts (``prompts``), bases (``bases``, ``media``), the case
matrix (``matrix``), one job per base (``jobs``) run by ``executors`` (local processes, Dask) into a
resumable partial run (``partial``), published by ``run.generate_set``; ``recompute.verify_set`` checks
a set against the oracle again. Imports ``conformance.sets``, ``conformance.protocol`` and refimpl;
never ``conformance.check``.

    from conformance.generate import generate_set, verify_set, load_prompts
"""

from .executors import ClusterError, WorkerLost
from .media import has_audio_tower, has_vision_tower, synthetic_image, synthetic_waveform
from .partial import PartialRun, PartialRunBusy, PartialRunMismatch, finished_bases, partial_dir
from .prompts import PromptError, load_prompts
from .recompute import RECOMPUTE_BOUND, verify_set
from .run import CONSISTENCY_BOUND, generate_set, publish_path

__all__ = ["CONSISTENCY_BOUND", "ClusterError", "PartialRun", "PartialRunBusy", "PartialRunMismatch", "PromptError",
           "RECOMPUTE_BOUND", "WorkerLost", "finished_bases", "generate_set", "has_audio_tower", "has_vision_tower",
           "load_prompts", "partial_dir", "publish_path", "synthetic_image", "synthetic_waveform", "verify_set"]
