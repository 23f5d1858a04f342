"""Replay: route each token through the experts the rollout recorded, with weights (and gradients)
from the trainer's live router logits, and measure how far live routing strays from the record."""

from .metrics import RoutingMismatch, routing_mismatch
from .op import ReplayFaultError, check_replay_errors, replay_fault_counter, replay_routing

__all__ = [
    "ReplayFaultError",
    "RoutingMismatch",
    "check_replay_errors",
    "replay_fault_counter",
    "replay_routing",
    "routing_mismatch",
]
