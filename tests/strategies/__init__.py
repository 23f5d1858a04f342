"""Shared hypothesis strategies, one module per stage of the data path. Each module's ``__all__`` is
re-exported here, so a test imports ``from strategies import X`` whichever module defines it, and a
new strategy is added to its module (and that module's ``__all__``) only.

- ``layouts``: memory layouts every kernel must honour (sliced, strided, transposed, expanded views)
  and the poison values that show a wrong read or write
- ``capture``: batches in every layout with their expected rows, infer_layout's shapes, ids near the
  buffer dtype's limits
- ``flashinfer``: FlashInfer's monolithic capture contract
- ``router``: routing configurations of real models, random shapes, router logits
- ``nonfinite``: logits with NaN, +-inf and -0.0 for every kernel path
- ``shapes``: routing shapes and rows; hostile model configs
- ``transfer``: the snapshot's narrowing cast and row counts around its buckets
- ``wire``: routing arrays, client texts (NeMo-RL) and hostile input for the decoders
- ``indexer``: indexer top-k position rows in every layout, with faults, and what they store
- ``replay``: recorded routings, mismatch metrics, the replay kernels' cases
- ``replayer``: batches a trainer sets, requests a client receives
- ``distributed``: process layouts, per-step counts and padding, rank-specific router inputs
- ``integrations``: transformers batches, Megatron-Core routers
- ``serving``: serving workloads for the runner and the end-to-end tests

The modules import one another in that order (a module imports only modules above it), never
``benchmarks``: the benchmarks' shapes live in ``benchmarks/cases.py``.
"""

# ruff: noqa: F403 - the star imports take exactly each module's __all__ (listed again below)

from __future__ import annotations

from . import (
    capture,
    distributed,
    flashinfer,
    indexer,
    integrations,
    layouts,
    nonfinite,
    replay,
    replayer,
    router,
    serving,
    shapes,
    transfer,
    wire,
)
from .capture import *
from .distributed import *
from .flashinfer import *
from .indexer import *
from .integrations import *
from .layouts import *
from .nonfinite import *
from .replay import *
from .replayer import *
from .router import *
from .serving import *
from .shapes import *
from .transfer import *
from .wire import *

__all__ = [
    *layouts.__all__,
    *capture.__all__,
    *flashinfer.__all__,
    *router.__all__,
    *nonfinite.__all__,
    *shapes.__all__,
    *transfer.__all__,
    *wire.__all__,
    *indexer.__all__,
    *replay.__all__,
    *replayer.__all__,
    *distributed.__all__,
    *integrations.__all__,
    *serving.__all__,
]
