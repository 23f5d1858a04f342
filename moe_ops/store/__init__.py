"""Store: host-side routing rows indexed by KV slot, and the request-lifecycle ledger on top."""

from .ledger import POLICIES, FinishedRouting, RoutingLedger, ScheduledStep
from .slot_store import SlotStore, slots_for

__all__ = ["POLICIES", "FinishedRouting", "RoutingLedger", "ScheduledStep", "SlotStore", "slots_for"]
