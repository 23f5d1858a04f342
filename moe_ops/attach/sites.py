"""The attach plumbing capture and replay share: where a wrapper goes, the checks, the handle.

Every ``attach_*`` - capture and replay, transformers, Megatron-Core and the reference model
(``moe_ops.models.attach_replay``) - finds its routers as :class:`RouterSite` s (where each is,
which instance attribute is replaced), checks them before any is touched
(:func:`check_against_shape`, :func:`check_device`, :func:`check_unwrapped`), sets the wrappers
with :func:`attach_wrappers` and returns an :class:`AttachHandle` (``remove()`` or a ``with``
block restores each attribute).

A wrapper carries a mark (:data:`CAPTURE_MARK`, :data:`REPLAY_MARK`) and the callable it wraps
(:func:`mark_wrapper`), so that a check sees every moe-ops wrapper of a router, not only the
outermost: a capture under a replay is as much attached as one on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from .replaying import ReplayRule

__all__ = [
    "CAPTURE_MARK",
    "REPLAY_MARK",
    "AttachHandle",
    "RouterSite",
    "attach_wrappers",
    "check_against_shape",
    "check_device",
    "check_unwrapped",
    "describe_output",
    "mark_wrapper",
]


# set on replaying and capturing wrappers, so that a second attach of one kind on a router is refused
REPLAY_MARK = "_moe_ops_replay"
CAPTURE_MARK = "_moe_ops_capture"
# set on every marked wrapper: the callable it wraps (the router's own, or another moe-ops wrapper)
_INNER = "_moe_ops_inner"


def mark_wrapper(wrapper: Callable, mark: str, inner: Callable) -> Callable:
    """``wrapper`` marked with ``mark`` (``CAPTURE_MARK``, ``REPLAY_MARK``), holding ``inner``, the
    callable it wraps, for :meth:`RouterSite.wrapped_by`. Returns ``wrapper``: attributes of a
    Python function, set once when wrapping (dynamo inlines the function and never reads them)."""
    setattr(wrapper, mark, True)
    setattr(wrapper, _INNER, inner)
    return wrapper


def describe_output(output: Any) -> str:
    """A router's output in words, for errors: tensors as shape and dtype, tuples recursively."""
    if isinstance(output, torch.Tensor):
        return f"a tensor {tuple(output.shape)} {output.dtype}"
    if isinstance(output, (tuple, list)):
        return "(" + ", ".join(describe_output(o) for o in output) + ")"
    return type(output).__name__


@dataclass(frozen=True)
class RouterSite:
    """One router an ``attach_*`` wraps, and the attribute it replaces on the router's instance."""

    # decoder-layer index (transformers, the reference model), or Megatron's (kind, index)
    layer: Any
    # module path in the model ("model.layers.3.mlp.gate"), for handles and messages
    path: str
    # the router module whose instance attribute is replaced
    module: nn.Module = field(repr=False, compare=False)
    # that attribute: "forward" (transformers), "router" (the reference model's MoE block),
    # "router_replay" (Megatron's hook)
    attr: str = "forward"

    def wrapped_by(self, mark: str) -> bool:
        """True when the attribute is a wrapper carrying ``mark`` (REPLAY_MARK, CAPTURE_MARK), or
        a moe-ops wrapper around one, however deep (a capture under a replay counts)."""
        wrapper = self.module.__dict__.get(self.attr)
        while wrapper is not None:
            if getattr(wrapper, mark, False):
                return True
            wrapper = getattr(wrapper, _INNER, None)
        return False


# what the instance __dict__ held for an attribute that was not there (a class attribute or method)
_ABSENT = object()


@dataclass
class AttachHandle:
    """What an ``attach_*`` attached; ``remove()`` (or leaving a ``with`` block) undoes it.

    One class for every integration: ``ReplayHandle`` and ``CaptureHandle`` (transformers, the
    reference model) and ``MegatronHandle`` are it, by name.
    """

    # "replay" or "capture": the attach_<what> that made this handle
    what: str
    # registry key of the model's architecture (config.model_type), "reference", or "megatron"
    arch: str
    # each wrapped router's layer (RouterSite.layer), strictly increasing
    layers: tuple[Any, ...]
    # module path of each wrapped router, same order as layers
    paths: tuple[str, ...]
    # replay: each router's weight rule when attached, same order as layers (the transformers
    # rules re-read the router's fields at every call: moe_ops.integrations.hf.replay_rule gives
    # the current one; Megatron's are for its config's logits dtype); capture: ()
    rules: tuple[ReplayRule, ...] = ()
    # (router, attribute, what its instance __dict__ held or _ABSENT, our wrapper); empty once removed
    _wrapped: list[tuple[nn.Module, str, Any, Any]] = field(repr=False, default_factory=list)
    # called once by the remove() that restores the routers (Megatron's dispatcher count)
    _on_remove: Callable[[], None] | None = field(repr=False, default=None)

    @property
    def attached(self) -> bool:
        """True until :meth:`remove`."""
        return bool(self._wrapped)

    def remove(self) -> None:
        """Restores every router's attribute; a second call does nothing.

        RuntimeError, before anything is restored, when some router's attribute was replaced
        after this handle was attached (another wrapper or handle on top: remove that one first).
        """
        for path, (module, attr, _, wrapper) in zip(self.paths, self._wrapped):
            if module.__dict__.get(attr) is not wrapper:
                raise RuntimeError(
                    f"the {attr} of the router at {path!r} was replaced after attach_{self.what} (a wrapper "
                    "or handle attached on top of this one): remove that handle first"
                )
        if not self._wrapped:
            return
        for module, attr, previous, _ in self._wrapped:
            if previous is _ABSENT:
                delattr(module, attr)
            else:
                setattr(module, attr, previous)
        self._wrapped = []
        if self._on_remove is not None:
            self._on_remove()

    def __enter__(self) -> AttachHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


H = TypeVar("H", bound=AttachHandle)


def attach_wrappers(
    handle_type: type[H],
    what: str,
    arch: str,
    sites: Sequence[RouterSite],
    wrappers: Sequence[Any],
    rules: Sequence[ReplayRule] = (),
    on_remove: Callable[[], None] | None = None,
) -> H:
    """Sets ``site.attr`` of each router to its wrapper (the same order) and returns the handle
    that restores them. Call it after every check: it changes the model and raises nothing."""
    wrapped = []
    for site, wrapper in zip(sites, wrappers, strict=True):
        previous = site.module.__dict__.get(site.attr, _ABSENT)
        setattr(site.module, site.attr, wrapper)
        wrapped.append((site.module, site.attr, previous, wrapper))
    return handle_type(
        what=what,
        arch=arch,
        layers=tuple(site.layer for site in sites),
        paths=tuple(site.path for site in sites),
        rules=tuple(rules),
        _wrapped=wrapped,
        _on_remove=on_remove,
    )


def check_against_shape(target: Any, sites: Sequence[RouterSite], name: str) -> None:
    """Checks the routers found against ``target.shape`` (a RoutingShape) when it has one: its
    ``moe_layers`` must be exactly the routers' layers, its ``top_k`` each router's ``top_k``.
    ``name`` ("capturer", "replayer") is the argument the messages name."""
    shape = getattr(target, "shape", None)
    moe_layers = getattr(shape, "moe_layers", None)
    if moe_layers is None:
        return
    found = tuple(site.layer for site in sites)
    if tuple(moe_layers) != found:
        raise ValueError(
            f"{name}.shape.moe_layers={tuple(moe_layers)} but the model's routers are in decoder "
            f"layers {found}: build the {name}'s shape from this model's config "
            "(moe_ops.resolve_routing_shape(model.config))"
        )
    top_k = getattr(shape, "top_k", None)
    for site in sites:
        router_k = getattr(site.module, "top_k", None)
        if isinstance(router_k, int) and top_k is not None and router_k != top_k:
            raise ValueError(
                f"{name}.shape.top_k={top_k} but the router at {site.path!r} picks top_k={router_k}"
            )


def check_device(target: Any, sites: Sequence[RouterSite], name: str) -> None:
    """ValueError when ``target.buffer`` (if it has one) is not on the device of a router's own
    parameters (meta parameters excepted)."""
    buffer = getattr(target, "buffer", None)
    if not isinstance(buffer, torch.Tensor):
        return
    for site in sites:
        for p in site.module.parameters(recurse=False):
            if p.device.type != "meta" and p.device != buffer.device:
                raise ValueError(
                    f"{name}.buffer is on {buffer.device} but the router at {site.path!r} has its weights "
                    f"on {p.device}: create the {name} on the model's device"
                )
            break


def check_unwrapped(sites: Sequence[RouterSite], mark: str, what: str) -> None:
    """ValueError naming the router when one already has a wrapper carrying ``mark``, outermost or
    under another wrapper (:meth:`RouterSite.wrapped_by`): one capture and one replay per router.
    ``what`` ("capture", "replay") is the attachment the message names."""
    for site in sites:
        if site.wrapped_by(mark):
            raise ValueError(
                f"the router at {site.path!r} already has a routing {what} attached: "
                "remove() that handle first"
            )
