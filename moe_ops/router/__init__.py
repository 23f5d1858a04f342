"""Route: every routing method as a PyTorch reference and one Triton kernel that routes and captures."""

from .methods import GroupScore, RoutingMethod
from .op import route

__all__ = ["GroupScore", "RoutingMethod", "route"]
