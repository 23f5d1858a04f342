"""Store: host-side routing rows indexed by KV slot, and the request-lifecycle ledger on top."""

from .ledger import FinishedRouting, RoutingLedger, ScheduledStep
from .slot_store import SlotStore, slots_for

__all__ = ["FinishedRouting", "RoutingLedger", "ScheduledStep", "SlotStore", "slots_for"]
