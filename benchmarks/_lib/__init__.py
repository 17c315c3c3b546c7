"""What the benchmark scripts share (``bench``), the report generator's parts (``figures``,
``sections``, ``records``) and the in-process A/B of two trees (``ab``). Private: the scripts
and ``report.py`` beside this folder are the commands; nothing here has a command line of its
own.

The repository root goes on ``sys.path`` right after the ``PYTHONPATH`` entries, ahead of any
installed copy of the packages: a script measures this tree's packages when run as ``python3
benchmarks/NAME.py`` from anywhere, or another tree's that ``PYTHONPATH`` names.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1 + sum(1 for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p),
                    str(ROOT))
