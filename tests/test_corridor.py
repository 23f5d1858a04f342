"""How many package files one call runs through (tests/corridor.py measures it): a replayed router
call crosses at most 8 files and comes back into one it left at most 4 times, whatever integration
wraps the router; a capture call crosses no more files than before the routing arguments were
written once (6, no return). A new hop in these corridors is a design change: make it on purpose,
then move the numbers here."""

from __future__ import annotations

import pytest
from corridor import KERNEL_ROOMS, captured_router_ids, reference_replayed_router, walk

REPLAY_FILES, REPLAY_RETURNS = 8, 4


def _trip(call, model_rooms=()):
    call()  # first-use allocations (the fault counters) are not the corridor
    return walk(call, end=KERNEL_ROOMS + model_rooms)


def test_a_transformers_replayed_router_call():
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'moe-ops[hf]')")
    from corridor import hf_replayed_router

    trip = _trip(hf_replayed_router())
    assert len(trip.files) <= REPLAY_FILES and trip.returns <= REPLAY_RETURNS, trip.stays
    assert trip.stays[-1] == "moe_ops/replay/kernels.py", "the call did not reach the replay kernel"


def test_the_reference_models_replayed_router_call():
    # the model's own router (moe_ops/models/reference.py, run first, live) is the model's business:
    # entered, not followed, as transformers' routers are no package file
    trip = _trip(reference_replayed_router(), ("moe_ops/models/reference.py",))
    replay_files = [f for f in trip.files if f != "moe_ops/models/reference.py"]
    assert len(replay_files) <= REPLAY_FILES and trip.returns <= REPLAY_RETURNS, trip.stays
    assert trip.stays[-1] == "moe_ops/replay/kernels.py"


def test_a_capture_call():
    trip = _trip(captured_router_ids())
    assert len(trip.files) <= 6 and trip.returns == 0, trip.stays
    assert trip.stays[-1] == "moe_ops/capture/kernels.py"
