"""``moe-ops demo``: routing capture end to end, verified row by row.

The package: :mod:`.serve` (requests and the serving loop), :mod:`.verify` (the reference run and
the row-by-row check), :mod:`.files` (``routing.npz``), :mod:`.train` (the training half and the
pictures), :mod:`.progress` (the status line), :mod:`.hf` (``--hf ARCH``) and :mod:`.inspect`
(``moe-ops inspect``, which says which values it read from a file and which it guessed);
:mod:`.command` runs the command. This module names them: each public name is imported from its
submodule on first use (PEP 562, as ``moe_ops`` does), so ``moe-ops inspect`` and the status line
(:mod:`.progress`) import no torch (``moe-ops inspect`` took 17-19 s on a 2-core machine, all of it
importing torch through this package; it reads numpy files).

The demo serves synthetic requests with the reference MoE model (``moe_ops.models``) the way a
serving engine does: continuous batching of prefill and decode rows in one step, requests joining
when a slot frees up and leaving when they have generated their tokens, batches padded up to
CUDA-graph capture sizes. Per mode (eager, compiled, and on CUDA the CUDA-graph modes) it runs the
same requests twice, with and without capture, and for the captured run:

    runner.step (capturer.set_step, padded step, route(..., capture=capturer.target(layer)))
      -> capturer.snapshot()           async device-to-host copy, landed a few steps later
      -> RoutingLedger.land            into the SlotStore, rows at the requests' KV slots
      -> RoutingLedger.collect         per finished request: (num_tokens - 1, num_moe_layers, top_k)

Each request's routing is then compared with an eager, uncaptured reference run of the model on
the request's tokens (teacher-forced: the tokens that mode generated). Any mismatched row, wrong
shape or capture fault makes the demo exit non-zero.

Then, per mode, the training half (:mod:`moe_ops.demo.train`; ``--no-train`` skips it): each
request's routing through the wire format and back, replayed in one float32 training step of the
same model with perturbed router weights (mismatch without and with replay, logprobs against the
rollout's), plotted to ``replay_mismatch.png``; and once, the same batch trained for a few steps with
replay, the trainer's own routing drifting from the rollout's step by step while the replayed one
stays on it: ``routing_drift.png``.

Per-request shape: ``(num_tokens - 1, num_moe_layers, top_k)`` with ``num_tokens`` = prompt +
generated tokens, as vLLM (``request.num_tokens - 1``) and SGLang (``req.seqlen - 1``) return
``routed_experts``: the last generated token is sampled but never run through the model, so it has
no routing.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

# public name -> the submodule that defines it
_EXPORTS = {
    "moe_ops.demo.command": ("main_demo",),
    "moe_ops.demo.files": ("write_routing",),
    "moe_ops.demo.inspect": ("inspect_file", "main_inspect", "read_routing_file"),
    "moe_ops.demo.progress": ("StatusLine",),
    "moe_ops.demo.serve": (
        "DemoRequest",
        "ServeResult",
        "greedy_step",
        "serve",
        "step_inputs",
        "synthetic_requests",
    ),
    "moe_ops.demo.verify": ("Verification", "reference_routing", "verify"),
}
_LAZY = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # what static tools read; at run time __getattr__ resolves these
    from .command import main_demo
    from .files import write_routing
    from .inspect import inspect_file, main_inspect, read_routing_file
    from .progress import StatusLine
    from .serve import DemoRequest, ServeResult, greedy_step, serve, step_inputs, synthetic_requests
    from .verify import Verification, reference_routing, verify


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'moe_ops.demo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _DemoPackage(types.ModuleType):
    """Keeps ``serve`` and ``verify`` the functions: importing the submodules ``serve.py`` and
    ``verify.py`` (which the command does) binds each module on its package under the same name,
    which would hide the function from ``from moe_ops.demo import serve``. The modules stay in
    ``sys.modules`` (``from moe_ops.demo.serve import ...`` reads them there)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _DemoPackage


__all__ = [
    "DemoRequest",
    "ServeResult",
    "StatusLine",
    "Verification",
    "greedy_step",
    "inspect_file",
    "main_demo",
    "main_inspect",
    "read_routing_file",
    "reference_routing",
    "serve",
    "step_inputs",
    "synthetic_requests",
    "verify",
    "write_routing",
]
