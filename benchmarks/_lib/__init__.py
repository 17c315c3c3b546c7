"""What the benchmark scripts share (``bench``), the report generator's parts (``figures``,
``sections``, ``records``) and the in-process A/B of two trees (``ab``); no command line here.

The repository root goes on ``sys.path`` right after the ``PYTHONPATH`` entries, ahead of any
installed copy: a script measures this tree's packages, or those of a tree ``PYTHONPATH`` names.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1 + sum(1 for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p),
                    str(ROOT))
