"""The on-disk format of fixture sets: what a case is (``case``), the format's names (``format``), a loaded
set (``fixture_set``), its integrity (``integrity``) and where sets are found (``bundled``). Imports only
``conformance.protocol`` and refimpl.

    from conformance.sets import load_set, bundled_sets, FixtureError
"""

from .bundled import bundled_set, bundled_sets, link_loop, set_paths
from .case import BaseMedia, Case, RowSpec, check_case, row_groups
from .fixture_set import FixtureSet
from .format import CASES, EXPECTED, MANIFEST, FixtureError, sha256_file
from .integrity import check_set, load_set

__all__ = ["CASES", "EXPECTED", "MANIFEST", "BaseMedia", "Case", "FixtureError", "FixtureSet", "RowSpec",
           "bundled_set", "bundled_sets", "link_loop", "check_case", "check_set", "load_set", "row_groups", "set_paths",
           "sha256_file"]
