"""The benchmarks' own tests (`python -m pytest benchmarks`): each benchmark's `--smoke` run, and what some print.

They start the benchmark scripts as a user would, with the process helpers of the package's tests.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
