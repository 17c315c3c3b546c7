"""What the benchmark scripts share (``bench``) and the report generator's parts (``figures``,
``sections``, ``records``). Private: the scripts and ``report.py`` beside this folder are the
commands; nothing here has a command line of its own.

The repository root goes on ``sys.path`` right after the ``PYTHONPATH`` entries, ahead of any
installed copy of the packages: a script measures this tree's packages when run as ``python3
benchmarks/NAME.py`` from anywhere, and an A/B run can still point ``PYTHONPATH`` at another
tree's (``report.py --ab``).
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1 + sum(1 for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p),
                    str(ROOT))
