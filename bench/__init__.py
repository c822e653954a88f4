"""The agentfast benchmark (issue 6): checkpoint cost, throughput, resume latency, peak RSS.

Run it with ``bash bench/run.sh`` (or ``python -m bench`` from the repository root); see
docs/benchmarks.md for what each part measures and the latest figures.
"""

import os
from pathlib import Path

#: Where the project's scripts keep what they download, build and measure, outside the repository:
#: hack/lib.sh's default (``AGENTFAST_CACHE``, else ``$XDG_CACHE_HOME/agentfast``, else
#: ``~/.cache/agentfast``). The tests (tests/helpers.py) and bench/cluster_*.py take it from here too.
CACHE = Path(os.environ.get("AGENTFAST_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentfast")
