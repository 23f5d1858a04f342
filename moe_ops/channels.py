"""Channels: the named payloads a routing row carries from the device to the client.

A channel is one array per row, with its own host dtype and row shape. Today every row carries one
channel, ``"ids"`` (the experts chosen, an integer array ``(num_layers, top_k)``); the snapshot
ring (:class:`~moe_ops.transfer.TransferPipeline`) and the slot store
(:class:`~moe_ops.store.SlotStore`) hold a small set of them, ids first, so a second payload -
routing weights beside the ids, ``(num_layers, top_k)`` float16 or float32 - rides the same slots,
ring and copies by naming one more :class:`Channel`::

    channel:  ids                          weights
    row:      (num_layers, top_k) uint8    (num_layers, top_k) float16
    ring:     pinned[s]["ids"]             pinned[s]["weights"]        (one slot, one snapshot)
    store:    arrays["ids"][slot]          arrays["weights"][slot]     (one KV slot)

Host-side description only (numpy dtypes): ``transfer/`` and ``store/`` both import this module,
which imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["IDS", "Channel", "channel_names", "check_channels", "pick_channel"]

# the name of the expert-id channel every row carries, first in every channel set
IDS = "ids"

# numpy kinds a channel may hold: signed and unsigned integers, floats (bfloat16 has no numpy dtype:
# it would travel as its 16 bits in a uint16 channel)
_KINDS = "iuf"


@dataclass(frozen=True)
class Channel:
    """One named payload of a routing row.

    Args:
        name: the channel's key (``"ids"``, ``"weights"``, ...): a Python identifier.
        dtype: numpy dtype of the host rows (an integer or float dtype); rows keep it bit for bit
            from the ring to the store.
        row_shape: the shape of one row, e.g. ``(num_layers, top_k)``; None: the shape of its
            holder's ids row (the store's routing row, the pipeline's source row).
    """

    # a Python identifier, unique within one channel set; "ids" is the expert ids
    name: str
    # np.dtype of kind i, u or f (normalised from anything np.dtype takes)
    dtype: np.dtype
    # tuple of ints >= 1, or None: the holder's ids row shape
    row_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"Channel name must be a Python identifier such as 'weights', got {self.name!r}")
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            raise ValueError(
                f"channel {self.name!r}: dtype must be a numpy integer or float dtype, got {self.dtype!r}"
            ) from None
        if dtype.kind not in _KINDS or dtype.byteorder == ">":
            raise ValueError(
                f"channel {self.name!r}: dtype must be a native numpy integer or float dtype, got {dtype}"
            )
        object.__setattr__(self, "dtype", dtype)
        if self.row_shape is not None:
            shape = tuple(self.row_shape) if isinstance(self.row_shape, (tuple, list)) else None
            if not shape or any(
                isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in shape
            ):
                raise ValueError(
                    f"channel {self.name!r}: row_shape must be None or a tuple of ints >= 1, "
                    f"got {self.row_shape!r}"
                )
            object.__setattr__(self, "row_shape", tuple(int(d) for d in shape))

    @property
    def fill(self) -> int | float:
        """The value of a row never written, or of a layer not captured this step: -1 for a signed
        dtype, its maximum for an unsigned one (-1 cast: not an id of a model with fewer experts),
        NaN for a float one (no weight is NaN)."""
        if self.dtype.kind == "f":
            return float("nan")
        info = np.iinfo(self.dtype)
        return -1 if info.min < 0 else int(info.max)

    def resolved(self, row_shape: tuple[int, ...]) -> Channel:
        """This channel with its ``row_shape`` None replaced by the holder's ``row_shape``."""
        if self.row_shape is None:
            return Channel(self.name, self.dtype, tuple(row_shape))
        return self


def check_channels(ids: Channel, extra: Iterable[Channel], argument: str) -> tuple[Channel, ...]:
    """``(ids, *extra)`` after the checks: each a :class:`Channel`, names unique, none of the extra
    ones named ``"ids"``. ValueError (TypeError for a non-Channel) naming ``argument``."""
    if isinstance(extra, (str, bytes, Channel)) or not isinstance(extra, Iterable):
        raise TypeError(f"{argument} must be a sequence of Channel, got {type(extra).__name__}")
    channels = [ids]
    for channel in extra:
        if not isinstance(channel, Channel):
            raise TypeError(f"{argument} must hold Channel objects, got {type(channel).__name__}")
        if channel.name in [c.name for c in channels]:
            taken = "the expert ids' channel" if channel.name == IDS else "taken"
            raise ValueError(f"{argument}: channel name {channel.name!r} is {taken}; names must be unique")
        channels.append(channel)
    return tuple(channels)


def channel_names(channels: Iterable[Channel]) -> tuple[str, ...]:
    return tuple(c.name for c in channels)


def pick_channel(channels: tuple[Channel, ...], name: object, argument: str = "channel") -> int:
    """Index of the channel called ``name``; ValueError naming ``argument``, the name and the
    configured channels otherwise."""
    for i, channel in enumerate(channels):
        if channel.name == name:
            return i
    raise ValueError(
        f"{argument}={name!r} is not a configured channel; expected one of {list(channel_names(channels))}"
    )
