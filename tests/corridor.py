"""How far one call travels through the package: the files (rooms) it enters, in order.

``python tests/corridor.py`` prints, for each corridor below, the package files one call enters, as
the Python profiler sees it run: a *stay* begins where a function of one package file calls into
another (through torch's dispatcher or not: a kernel registered by ``moe_ops._runtime.library`` and
called back by the dispatcher is entered from the file that called the op); calls within a file and
returns to a caller are not stays, as a walk that follows the calls down counts them. Code outside
``moe_ops`` and ``graphs`` (torch, transformers, Megatron) is no room. *Returns* are the stays that
enter a file the call had already entered (stays = files + returns). The trip ends at the kernel's
room: what happens inside the launcher or the PyTorch twin is the kernel's own business.

tests/test_corridor.py holds the targets: one replayed router call in at most 8 files with at most
4 returns, whatever integration wraps the router.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PACKAGE_DIRS = (str(ROOT / "moe_ops") + "/", str(ROOT / "graphs") + "/")


@dataclass
class Trip:
    """The rooms one call entered, in order (a stay per entry)."""

    # package-relative file of each stay, in order
    stays: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(self.stays))

    @property
    def returns(self) -> int:
        return len(self.stays) - len(self.files)

    def summary(self) -> str:
        return f"{len(self.stays)} stays, {len(self.files)} files, {self.returns} returns"


def _room(filename: str) -> str | None:
    for prefix in _PACKAGE_DIRS:
        if filename.startswith(prefix):
            return str(Path(filename).relative_to(ROOT))
    return None


def _caller_room(frame) -> str | None:
    """The package file of the nearest package frame above ``frame`` (its caller, through torch)."""
    f = frame.f_back
    while f is not None:
        room = _room(f.f_code.co_filename)
        if room is not None:
            return room
        f = f.f_back
    return None


def _inside(frame, rooms: tuple[str, ...]) -> bool:
    """Whether a frame above ``frame`` runs in one of ``rooms``."""
    f = frame.f_back
    while f is not None:
        if _room(f.f_code.co_filename) in rooms:
            return True
        f = f.f_back
    return False


def walk(call: Callable[[], object], *, end: tuple[str, ...] = ()) -> Trip:
    """Runs ``call()`` once under the profiler and returns its trip. ``end``: package-relative files
    where the trip ends (entered, never followed inside: the kernels' rooms)."""
    trip = Trip()

    def profile(frame, event, arg):
        if event != "call":
            return
        room = _room(frame.f_code.co_filename)
        if room is None:
            return
        caller = _caller_room(frame)
        if _inside(frame, end):
            return  # inside a kernel's room
        # a call from another file enters this one: a new stay, unless the call before entered it
        # too (one stay through several functions of a file, as the caller calls them in turn)
        if (caller != room or not trip.stays) and (not trip.stays or trip.stays[-1] != room):
            trip.stays.append(room)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return trip


# ---------------------------------------------------------------------------------------------------
# The corridors
# ---------------------------------------------------------------------------------------------------

# the kernels' rooms: a trip ends where it enters one (the launcher or the PyTorch twin)
KERNEL_ROOMS = (
    "moe_ops/replay/kernels.py",
    "moe_ops/router/kernels.py",
    "moe_ops/router/hash_kernels.py",
    "moe_ops/capture/kernels.py",
)


def hf_replayed_router(arch: str = "qwen3_moe", n: int = 6) -> Callable[[], object]:
    """One call of a transformers router wrapped by ``attach_replay`` (a tiny real model, CPU)."""
    import torch

    from moe_ops import RoutingReplayer, attach_replay, resolve_routing_shape
    from moe_ops.integrations.hf import build_tiny_model

    model = build_tiny_model(arch)
    shape = resolve_routing_shape(model.config)
    replayer = RoutingReplayer(shape, n, "cpu")
    attach_replay(model, replayer)
    replayer.set_batch(-torch.ones(n, shape.num_layers, shape.top_k, dtype=torch.int32))
    layer = shape.moe_layers[0]
    gate = model.model.layers[layer].mlp.gate
    hidden = torch.randn(n, model.config.hidden_size, requires_grad=True)
    return lambda: gate(hidden)


def reference_replayed_router(n: int = 6) -> Callable[[], object]:
    """One call of the reference model's router wrapped by its ``attach_replay``."""
    import torch

    from moe_ops import RoutingReplayer
    from moe_ops.models import ReferenceMoEModel, attach_replay, reference_config

    config = reference_config("tiny")
    model = ReferenceMoEModel(config)
    shape = config.routing_shape()
    replayer = RoutingReplayer(shape, n, "cpu")
    attach_replay(model, replayer)
    replayer.set_batch(-torch.ones(n, shape.num_layers, shape.top_k, dtype=torch.int32))
    block = model.layers[config.moe_layers[0]].mlp
    hidden = torch.randn(n, model.config.hidden_size, requires_grad=True)
    return lambda: block.router(hidden)


def captured_router_ids(n: int = 6) -> Callable[[], object]:
    """One ``RoutingCapturer.capture`` call (ids only, LOCAL)."""
    import torch

    from moe_ops import RoutingCapturer, RoutingShape

    shape = RoutingShape(num_layers=2, num_experts=8, top_k=2)
    capturer = RoutingCapturer(shape, max_num_tokens=n, device="cpu")
    capturer.set_step([n])
    ids = torch.zeros(n, 2, dtype=torch.int32)
    return lambda: capturer.capture(0, ids)


# name -> (the call's builder, the rooms where its trip ends besides the kernels': the model's own
# router, which the replaying wrapper calls first, is the model's business)
CORRIDORS = {
    "replayed router call (transformers)": (hf_replayed_router, ()),
    "replayed router call (reference model)": (reference_replayed_router, ("moe_ops/models/reference.py",)),
    "capture call (RoutingCapturer.capture)": (captured_router_ids, ()),
}


def main() -> None:
    for name, (build, model_rooms) in CORRIDORS.items():
        call = build()
        call()  # warm: first-use allocations (fault counters) are not the corridor
        trip = walk(call, end=KERNEL_ROOMS + model_rooms)
        print(f"{name}: {trip.summary()}")
        for room in trip.stays:
            print(f"    {room}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
