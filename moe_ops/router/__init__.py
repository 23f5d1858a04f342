"""Route: every routing method as a PyTorch reference and one Triton kernel that routes and captures."""

from .methods import GroupScore, RoutingMethod
from .nonfinite import NonFiniteRowsError, check_nonfinite_rows
from .op import route

__all__ = ["GroupScore", "NonFiniteRowsError", "RoutingMethod", "check_nonfinite_rows", "route"]
