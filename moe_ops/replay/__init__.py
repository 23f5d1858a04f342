"""Replay: route each token through the experts the rollout recorded, with weights (and gradients)
from the trainer's live router logits."""

from .op import ReplayFaultError, check_replay_errors, replay_fault_counter, replay_routing

__all__ = [
    "ReplayFaultError",
    "check_replay_errors",
    "replay_fault_counter",
    "replay_routing",
]
