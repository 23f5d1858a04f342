"""``SlotStore``: host-side routing rows indexed like a paged KV cache.

A token's routing lives at the slot of its KV entry, ``slot = block_id * block_size + offset``, so
the store follows the KV cache for free: a request that hits the prefix cache reads the routing of
the request that computed those blocks, exactly as it reads their keys and values::

    data: | slot 0 | slot 1 | ... |      one (num_layers, top_k) row per slot
    request with blocks [7, 2], block_size 4, tokens 0..5:
        token: 0    1    2    3    4    5
        slot:  28   29   30   31   8    9

Each slot holds one row per channel (:mod:`moe_ops.channels`): ``"ids"`` always, first, and the
channels named at construction (e.g. a float16 ``"weights"`` row beside the ids), each an array of
its own dtype and row shape, written together and read by name.

All of it is host memory (numpy) and host work: the store never touches a device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..channels import IDS, Channel, channel_names, check_channels, pick_channel
from ..shapes import RoutingShape

__all__ = ["SlotStore", "slots_for"]


def _index_array(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _blocks_of_tokens(
    block_ids: Sequence[int] | np.ndarray, block_size: int, start: int, num_tokens: int
) -> tuple[np.ndarray, int, int, int]:
    """Checks a request's block list against tokens ``[start, start + num_tokens)``.

    Returns (used block ids, block_size, start, index of the first used block); ``used`` is empty
    when ``num_tokens`` is 0. IndexError when the blocks do not cover the tokens.
    """
    blocks = _index_array("block_ids", block_ids)
    block_size = _check_count("block_size", block_size, 1)
    start = _check_count("start", start, 0)
    num_tokens = _check_count("num_tokens", num_tokens, 0)
    end = start + num_tokens
    if end > blocks.size * block_size:
        raise IndexError(
            f"tokens [{start}, {end}) need {-(-end // block_size)} blocks of {block_size}, but only "
            f"{blocks.size} block ids were given"
        )
    if num_tokens == 0:
        return blocks[:0], block_size, start, 0
    first, last = start // block_size, (end - 1) // block_size
    return blocks[first : last + 1], block_size, start, first


def slots_for(
    block_ids: Sequence[int] | np.ndarray, block_size: int, start: int, num_tokens: int
) -> np.ndarray:
    """(num_tokens,) int64 slots of the tokens ``[start, start + num_tokens)`` of a request whose KV
    blocks are ``block_ids``: ``block_ids[t // block_size] * block_size + t % block_size``.

    IndexError when the blocks do not cover the tokens or a block id is negative.
    """
    used, block_size, start, first = _blocks_of_tokens(block_ids, block_size, start, num_tokens)
    if used.size == 0:
        return np.empty(0, dtype=np.int64)
    if used.min() < 0:
        raise IndexError(f"block ids must be >= 0, got {used[used < 0][:8].tolist()}")
    t = np.arange(start, start + num_tokens, dtype=np.int64)
    return used[t // block_size - first] * block_size + t % block_size


class SlotStore:
    """Routing rows of ``num_slots`` KV slots: a ``(num_slots, num_layers, top_k)`` host array.

    Args:
        num_slots: KV slots of the cache (``num_blocks * block_size``).
        routing_shape: the model's :class:`~moe_ops.RoutingShape`.
        dtype: numpy integer dtype of the rows (None: ``routing_shape.id_dtype``, the narrow dtype
            from the expert count).
        extra_channels: the :class:`~moe_ops.channels.Channel` s each slot holds beside the ids
            (e.g. ``Channel("weights", np.float16)``; a ``row_shape`` of None is the ids' row
            ``(num_layers, top_k)``). Empty (default): the ids alone, as before channels.

    ``channels`` is ``(ids, *extra_channels)``; ``arrays[name]`` is channel ``name``'s
    ``(num_slots, *row_shape)`` array and ``data`` is ``arrays["ids"]``. Slots never written read
    as each channel's fill (``fill`` is the ids': -1 for signed dtypes, the dtype's maximum for
    unsigned ones; NaN for a float channel). Out-of-range slots and blocks raise IndexError:
    nothing wraps around, negative indices included.
    """

    def __init__(
        self,
        num_slots: int,
        routing_shape: RoutingShape,
        dtype: np.dtype | type | None = None,
        *,
        extra_channels: Sequence[Channel] = (),
    ):
        if not isinstance(routing_shape, RoutingShape):
            raise TypeError(f"routing_shape must be a RoutingShape, got {type(routing_shape).__name__}")
        self.num_slots = _check_count("num_slots", num_slots, 1)
        self.shape = routing_shape
        self.dtype = routing_shape.id_dtype if dtype is None else np.dtype(dtype)
        if self.dtype.kind not in "iu":
            raise ValueError(f"dtype must be an integer dtype, got {self.dtype}")
        info = np.iinfo(self.dtype)
        if routing_shape.num_experts - 1 > info.max:
            raise ValueError(
                f"dtype {self.dtype} cannot hold expert ids up to {routing_shape.num_experts - 1}"
            )
        # value of never-written slots: -1, or the largest value of an unsigned dtype (not an id
        # of a model with fewer experts than that)
        self.fill = -1 if info.min < 0 else int(info.max)
        row = (routing_shape.num_layers, routing_shape.top_k)
        ids = Channel(IDS, self.dtype, row)
        # (ids, *extra_channels), each with its row_shape resolved; names unique
        self.channels: tuple[Channel, ...] = tuple(
            c.resolved(row) for c in check_channels(ids, extra_channels, "extra_channels")
        )
        self.data = np.full((self.num_slots, *row), self.fill, self.dtype)
        # channel name -> its (num_slots, *row_shape) array, ids first; data is arrays["ids"]
        self.arrays: dict[str, np.ndarray] = {IDS: self.data}
        for channel in self.channels[1:]:
            self.arrays[channel.name] = np.full(
                (self.num_slots, *channel.row_shape), channel.fill, channel.dtype
            )

    @property
    def row_shape(self) -> tuple[int, int]:
        """(num_layers, top_k): the shape of one slot's row."""
        return self.data.shape[1:]

    @property
    def nbytes(self) -> int:
        """Bytes of every channel's array."""
        return sum(a.nbytes for a in self.arrays.values())

    def _check_slots(self, slots: np.ndarray) -> None:
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            bad = slots[(slots < 0) | (slots >= self.num_slots)]
            raise IndexError(f"slots must be in [0, {self.num_slots}), got {bad[:8].tolist()}")

    def write(
        self, slot_mapping: Sequence[int] | np.ndarray, rows: np.ndarray | Mapping[str, np.ndarray]
    ) -> None:
        """Stores ``rows[i]`` at slot ``slot_mapping[i]`` (vectorised; a later duplicate wins).

        Args:
            slot_mapping: (n,) integer - one KV slot per row, each in ``[0, num_slots)``.
            rows: (n, num_layers, top_k) integer - the ids, e.g. ``SnapshotHandle.result()``; or a
                mapping of every channel's name to its ``(n, *row_shape)`` rows, e.g.
                ``SnapshotHandle.results()`` (required when the store has extra channels: a slot
                never holds one channel of one step and another of an earlier one).

        Raises IndexError for an out-of-range slot and ValueError for a wrong shape, a non-integer
        dtype or a value the store's dtype cannot hold, and for a channel missing, not configured,
        or of a dtype that does not cast exactly to its channel's; the store is unchanged when it
        raises.
        """
        slots = _index_array("slot_mapping", slot_mapping)
        checked = self._check_channel_rows(rows, slots.size)
        self._check_slots(slots)
        for name, values in checked.items():
            self.arrays[name][slots] = values

    def _check_channel_rows(
        self, rows: np.ndarray | Mapping[str, np.ndarray], num_rows: int, name: str = "rows"
    ) -> dict[str, np.ndarray]:
        """Every channel's rows after the checks of :meth:`write`, ids first: a bare array is the
        ids (only where the store has no other channel), a mapping must name each channel once."""
        if rows.__class__ is np.ndarray and len(self.channels) == 1:  # the ids alone: no ABC check
            return {IDS: self._check_rows(rows, num_rows, name)}
        if not isinstance(rows, Mapping):
            if len(self.channels) > 1:
                raise ValueError(
                    f"{name} must be a mapping of every channel {list(channel_names(self.channels))} to "
                    f"its rows (this store holds {len(self.channels)} channels), got "
                    f"{type(rows).__name__}"
                )
            return {IDS: self._check_rows(rows, num_rows, name)}
        for key in rows:
            pick_channel(self.channels, key, f"a key of {name}")
        checked = {}
        for channel in self.channels:
            if channel.name not in rows:
                raise ValueError(
                    f"{name} lacks channel {channel.name!r}: expected the rows of every channel "
                    f"{list(channel_names(self.channels))}"
                )
            label = f"{name}[{channel.name!r}]"
            if channel.name == IDS:
                checked[IDS] = self._check_rows(rows[IDS], num_rows, label)
            else:
                checked[channel.name] = _check_channel(channel, rows[channel.name], num_rows, label)
        return checked

    def _check_rows(self, rows: np.ndarray, num_rows: int, name: str = "rows") -> np.ndarray:
        """``rows`` as an array after the checks of :meth:`write`: shape ``(num_rows, L, K)``, an
        integer dtype, values the store's dtype can hold (ValueError naming ``name`` otherwise).
        The value range is only scanned when the dtype does not cast safely."""
        rows = np.asarray(rows)
        expected = (num_rows, *self.row_shape)
        if rows.shape != expected:
            raise ValueError(f"{name} must have shape {expected} (one row per slot), got {rows.shape}")
        if rows.size and rows.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold integers, got dtype {rows.dtype}")
        if rows.size and not np.can_cast(rows.dtype, self.dtype, casting="safe"):
            info = np.iinfo(self.dtype)
            lo, hi = int(rows.min()), int(rows.max())
            if lo < info.min or hi > info.max:
                raise ValueError(
                    f"{name} hold values in [{lo}, {hi}] that the store's dtype {self.dtype} cannot hold"
                )
        return rows

    def read_slots(self, slots: Sequence[int] | np.ndarray, *, channel: str = IDS) -> np.ndarray:
        """A copy of the rows at ``slots``: (len(slots), num_layers, top_k) ids, or
        ``(len(slots), *row_shape)`` of ``channel``. IndexError out of range; ValueError for a
        channel the store does not hold."""
        data = self.arrays[self.channels[pick_channel(self.channels, channel)].name]
        slots = _index_array("slots", slots)
        self._check_slots(slots)
        return data[slots]

    def read(
        self,
        block_ids: Sequence[int] | np.ndarray,
        num_tokens: int,
        block_size: int,
        start: int = 0,
        *,
        channel: str = IDS,
    ) -> np.ndarray:
        """A copy of the rows of tokens ``[start, start + num_tokens)`` of a request whose KV blocks
        are ``block_ids``: shape (num_tokens, num_layers, top_k) of the ids, or
        ``(num_tokens, *row_shape)`` of ``channel``.

        IndexError when the blocks do not cover the tokens, or a block id is negative or past the
        store's slots; ValueError for a channel the store does not hold.
        """
        spec = self.channels[pick_channel(self.channels, channel)]
        data, row_shape = self.arrays[spec.name], spec.row_shape
        used, block_size, start, first = _blocks_of_tokens(block_ids, block_size, start, num_tokens)
        if used.size == 0:
            return np.empty((0, *row_shape), dtype=spec.dtype)
        num_blocks = self.num_slots // block_size
        if used.min() < 0 or used.max() >= num_blocks:
            bad = used[(used < 0) | (used >= num_blocks)]
            raise IndexError(
                f"block ids must be in [0, {num_blocks}) ({self.num_slots} slots / block_size "
                f"{block_size}), got {bad[:8].tolist()}"
            )
        # Whole blocks are contiguous: gather them as (blocks, block_size, L, K) chunks, one memcpy
        # each, then cut the token range out of the gathered (contiguous) copy.
        paged = data[: num_blocks * block_size].reshape(num_blocks, block_size, *row_shape)
        gathered = paged[used].reshape(-1, *row_shape)
        offset = start - first * block_size
        return gathered[offset : offset + num_tokens]


def _check_channel(channel: Channel, rows: object, num_rows: int, name: str) -> np.ndarray:
    """``rows`` of an extra channel as an array: shape ``(num_rows, *row_shape)``, a dtype of the
    channel's kind; integers the channel's dtype holds (range scanned only for an unsafe cast),
    floats of a dtype that casts exactly (float16 into a float32 channel, not float32 into float16:
    the store never keeps a rounded value in place of the one given). ValueError naming ``name``."""
    rows = np.asarray(rows)
    expected = (num_rows, *channel.row_shape)
    if rows.shape != expected:
        raise ValueError(f"{name} must have shape {expected} (channel {channel.name!r}), got {rows.shape}")
    if not rows.size:
        return rows
    if channel.dtype.kind == "f":
        if rows.dtype.kind != "f" or not np.can_cast(rows.dtype, channel.dtype, casting="safe"):
            raise ValueError(
                f"{name} must hold floats that cast exactly to {channel.dtype} (channel "
                f"{channel.name!r}), got dtype {rows.dtype}"
            )
        return rows
    if rows.dtype.kind not in "iu":
        raise ValueError(
            f"{name} must hold integers (channel {channel.name!r} is {channel.dtype}), got dtype {rows.dtype}"
        )
    if not np.can_cast(rows.dtype, channel.dtype, casting="safe"):
        info = np.iinfo(channel.dtype)
        lo, hi = int(rows.min()), int(rows.max())
        if lo < info.min or hi > info.max:
            raise ValueError(
                f"{name} hold values in [{lo}, {hi}] that channel {channel.name!r}'s dtype "
                f"{channel.dtype} cannot hold"
            )
    return rows
