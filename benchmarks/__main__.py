"""``python -m benchmarks``: the runner (:func:`benchmarks.registry.main`).

The status line is drawn before anything heavy is imported (torch, moe_ops' ops and every
``bench_*.py``: 3-4 s warm on 2 CPU cores, far more on cold caches), so that a terminal shows at
once that the run started; ``moe_ops.demo.progress`` imports no torch.
"""

import sys

from moe_ops.demo.progress import StatusLine

status = StatusLine()
status.phase("benchmarks: importing torch, moe_ops and every benchmarks/bench_*.py")

from benchmarks.registry import main  # noqa: E402 - after the first status line

sys.exit(main(status=status))
