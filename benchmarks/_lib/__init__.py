"""What the benchmark scripts share (``bench``) and the report generator's parts (``figures``,
``sections``, ``records``). Private: the scripts and ``report.py`` beside this folder are the
commands; nothing here has a command line of its own.

The repository root is appended to ``sys.path`` (after ``PYTHONPATH``), so a script finds the
packages it measures when run as ``python3 benchmarks/NAME.py`` from anywhere, and an A/B run
can point ``PYTHONPATH`` at another tree's packages (``report.py --ab``).
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
