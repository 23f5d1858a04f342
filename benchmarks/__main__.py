"""``python -m benchmarks``: the runner (:func:`benchmarks.registry.main`)."""

import sys

from benchmarks.registry import main

sys.exit(main())
