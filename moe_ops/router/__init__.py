"""Route: every routing method as a PyTorch reference and one Triton kernel that routes and captures."""

from .methods import RoutingMethod
from .op import route

__all__ = ["RoutingMethod", "route"]
