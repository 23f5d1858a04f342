"""Routing capture across processes: the DP, EP and SP batch layouts on ``torch.distributed``.

A process layout of ``dp_size x tp_size`` ranks (``world = dp_size * tp_size``) numbers its ranks
DP-major, so the TP ranks of one DP rank are consecutive (vLLM's order)::

    dp_size 2, tp_size 2:   rank 0 = (d0, t0)   rank 1 = (d0, t1)   rank 2 = (d1, t0)   rank 3 = (d1, t1)
    TP groups   [0 1] [2 3]     one DP rank's batch, replicated or cut into SP chunks
    DP groups   [0 2] [1 3]     one TP position of every DP rank: the count exchange, naive dispatch
    EP group    [0 1 2 3]       every rank (experts sharded over DP x TP): SHARDED dispatch

Every DP rank ``d`` runs ``c_d`` real tokens padded to ``p_d`` rows (its CUDA-graph size; ``c_d``
itself when it runs unpadded). What the MoE layer routes, per :class:`~moe_ops.BatchLayout`
(``a b c`` DP rank 0's real tokens, ``d e`` DP rank 1's, ``-`` padding)::

    LOCAL              DP only: every rank routes its own padded batch
        d0: | a  b  c  - |      d1: | d  e  -  - |         d0 records rows [0, 3), d1 rows [0, 2)

    GATHERED           naive dispatch: the padded batches all-gathered over the DP group
        every rank: | a  b  c  - | d  e  -  - |            local_sizes = [4, 4]
                    |<- p_0 = 4->|<- p_1 = 4->|            d1 records rows [4, 6)

    SHARDED            SP chunks ceil(p_d / tp) all-gathered over the EP group, DP-then-TP
        d0 t0: | a  b |   d0 t1: | c  - |   d1 t0: | d  e |   d1 t1: | -  - |
        every rank: | a  b | c  - | d  e | -  - |          local_sizes = [2, 2, 2, 2]
                    |<--- DP rank 0 -->|<--- DP rank 1 -->|   d1 (both TP ranks) records rows [4, 6)

    SEQUENCE_PARALLEL  TP with SP: every TP rank routes its chunk; the capture all-gathers the ids
        d0 t0: | a  b |   d0 t1: | c  - |   -> TP gather: | a  b  c  - |   d0 t0 and t1 record [0, 3)

Per step, on every rank::

    plan = step.plan(num_rows)            # host, collective: every rank's padded rows, checked on all
    step.begin(plan, num_tokens)          # device: all-gather of (count, rows) -> capturer.set_step
    weights, ids = step.route(plan, layer, router_logits, top_k, method)   # dispatch, route, capture

Shapes are host values and counts are device values. The padded row counts are the shapes of the
tensors, so every rank knows its own on the host; :meth:`DistributedStep.plan` shares them with one
host all-gather (what vLLM's DP coordination does before a forward) and checks them on every rank
from the same numbers, so a batch that does not fit raises the same ValueError everywhere before
any device collective can hang. A plan stays valid while the shapes do: build it once per CUDA-graph
size. The real counts never leave the device: :meth:`DistributedStep.begin` all-gathers them over
the DP group (functional collectives, traced by ``torch.compile``) together with the padded rows, and
derives the shard sizes the capture reads (vLLM's ``local_sizes``) from them on the device.

After the rollout, :func:`gather_routing` brings every rank's captured routing to one rank in the
wire format a client receives, and :func:`scatter_routing` hands a trainer its share, in whatever
data-parallel split the trainer uses; ``replay_routing`` then replays it.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._runtime.faults import cpu_counter_lock
from ._runtime.library import destination_op
from .capture.errors import FAULT_SLOT, FAULT_SOURCE_SHORT
from .capture.monolithic import MoEDispatchConfig
from .capture.target import check_process_group
from .layout import BatchLayout, layout_from_value
from .router import RoutingMethod, route
from .wire import decode_routing, encode_routing

__all__ = [
    "DistributedStep",
    "ParallelLayout",
    "ProcessGroups",
    "StepPlan",
    "gather_routing",
    "scatter_routing",
]

_SP_LAYOUTS = (BatchLayout.SHARDED, BatchLayout.SEQUENCE_PARALLEL)
_DISPATCHED = (BatchLayout.GATHERED, BatchLayout.SHARDED)
# marks an entry of the plan's host exchange that the rank could not fill (a bad num_rows)
_INVALID = -1
# rows and counts travel as int32 on the device
_INT32_MAX = (1 << 31) - 1
# what the step uses of a RoutingCapturer
_CAPTURER_FIELDS = (
    "buffer",
    "set_step",
    "target",
    "device",
    "dp_size",
    "dp_rank",
    "shards_per_rank",
    "max_num_tokens",
    "fault_counter",
)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _host_all_gather(mine: Sequence[int], group: Any) -> list[list[int]]:
    """COLLECTIVE (host): every rank's ``mine`` (ints, the same count on every rank) over the gloo
    ``group``, rank order. One all-gather of int64 CPU tensors."""
    import torch.distributed as dist

    n = len(mine)
    table = torch.empty(dist.get_world_size(group) * n, dtype=torch.int64)
    # all_gather_single replaces all_gather_into_tensor in torch 2.13; 2.11 only has the latter.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(table, torch.tensor(list(mine), dtype=torch.int64), group=group)
    return table.view(-1, n).tolist()


def _layout_fields(layout: ParallelLayout) -> tuple[int, int, int, int]:
    """What ranks exchange of their layout, in ProcessGroups.build and in every plan."""
    return layout.dp_size, layout.tp_size, int(layout.use_ep), int(layout.layout)


def _check_layouts(fields_of: Sequence[Sequence[int]], where: str) -> None:
    """The same ValueError on every rank when the gathered ``_layout_fields`` differ (every rank
    holds the same table): ranks that disagree on the layout would issue different collectives
    and wait for each other until the timeout."""
    kinds: dict[tuple[int, ...], list[int]] = {}
    for rank, fields in enumerate(fields_of):
        kinds.setdefault(tuple(fields), []).append(rank)
    if len(kinds) == 1:
        return

    def text(fields: tuple[int, ...]) -> str:
        dp, tp, use_ep, layout = fields
        return f"dp_size={dp} x tp_size={tp}, use_ep={bool(use_ep)}, {BatchLayout(layout).name}"

    parts = "; ".join(f"ranks {ranks} have {text(fields)}" for fields, ranks in kinds.items())
    raise ValueError(
        f"{where}: the ranks disagree on the ParallelLayout ({parts}); every rank must use the same "
        "(raised on every rank)"
    )


def _default_timeout(group: Any) -> datetime.timedelta | None:
    """The collective timeout of ``group`` (the default group: ``init_process_group(timeout=)``),
    or None when its backend does not expose one.

    torch has no public getter: ``new_group`` without ``timeout=`` takes torch's default for the
    backend (30 minutes for gloo), not the default group's. The backend's options hold the value
    the group was created with (``ProcessGroup._get_backend(device).options._timeout``: gloo and
    NCCL, torch 2.11 and 2.13).
    """
    for device in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


@dataclass(frozen=True)
class ParallelLayout:
    """A process layout: ``dp_size x tp_size`` ranks, optional EP, and the batch the MoE layer routes.

    Raises ValueError on construction for sizes that are not ints >= 1, a layout that is not a
    :class:`~moe_ops.BatchLayout`, and SHARDED without ``use_ep`` (it gathers over the EP group).
    """

    # data-parallel ranks, >= 1
    dp_size: int
    # tensor-parallel ranks per DP rank, >= 1
    tp_size: int = 1
    # experts sharded over all dp_size * tp_size ranks (the EP group); False: no expert parallelism
    use_ep: bool = False
    # what the router sees: LOCAL (DP only), GATHERED (naive dispatch over the DP group), SHARDED
    # (SP chunks gathered over the EP group), SEQUENCE_PARALLEL (TP chunks, ids gathered by the capture)
    layout: BatchLayout | int = BatchLayout.LOCAL

    def __post_init__(self) -> None:
        _positive_int("dp_size", self.dp_size)
        _positive_int("tp_size", self.tp_size)
        if not isinstance(self.use_ep, bool):
            raise ValueError(f"use_ep must be a bool, got {self.use_ep!r}")
        layout = layout_from_value(self.layout)
        if layout == BatchLayout.SHARDED and not self.use_ep:
            raise ValueError(
                "SHARDED gathers the SP chunks of every rank over the EP group (all dp_size * tp_size "
                "ranks): set use_ep=True"
            )
        object.__setattr__(self, "layout", layout)

    @property
    def world_size(self) -> int:
        """Processes the layout needs: ``dp_size * tp_size``."""
        return self.dp_size * self.tp_size

    @property
    def ep_size(self) -> int:
        """Ranks the experts are sharded over: ``dp_size * tp_size`` with EP, else 1."""
        return self.world_size if self.use_ep else 1

    @property
    def dispatch_group_size(self) -> int:
        """Ranks whose batches a dispatched MoE layer sees at once, as ``MoEDispatchConfig`` counts
        them: ``ep_size`` with EP, else ``dp_size``."""
        return self.ep_size if self.use_ep else self.dp_size

    @property
    def shards_per_rank(self) -> int | None:
        """The ``RoutingCapturer`` ``shards_per_rank`` this layout's capture reads: None (LOCAL,
        SEQUENCE_PARALLEL), 1 (GATHERED: one padded size per DP rank), ``tp_size`` (SHARDED)."""
        if self.layout == BatchLayout.GATHERED:
            return 1
        if self.layout == BatchLayout.SHARDED:
            return self.tp_size
        return None

    def ranks_of(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, tp_rank)`` of global rank ``rank`` (DP-major: ``rank = dp_rank * tp + tp_rank``)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return divmod(rank, self.tp_size)

    def rows_fed(self, padded_rows: int) -> int:
        """Rows one rank's tensors have entering the MoE layer for a DP batch of ``padded_rows``:
        its SP chunk ``ceil(padded_rows / tp_size)`` in SHARDED and SEQUENCE_PARALLEL, else all."""
        if self.layout in _SP_LAYOUTS:
            return _ceil_div(padded_rows, self.tp_size)
        return padded_rows

    def dispatch_config(self, max_num_tokens: int, top_k: int) -> MoEDispatchConfig:
        """The ``MoEDispatchConfig`` of a monolithic experts kernel in this layout, for DP batches of
        at most ``max_num_tokens`` rows (padding included): its scratch holds the dispatch group's
        gathered batch. ``max_num_tokens`` of the config is what ONE rank feeds the layer (the SP
        chunk in SHARDED). ValueError for SEQUENCE_PARALLEL: a kernel there sees a TP chunk that
        only the capture's TP all-gather completes, which the monolithic contract does not do."""
        if self.layout == BatchLayout.SEQUENCE_PARALLEL:
            raise ValueError(
                "monolithic experts capture LOCAL, GATHERED or SHARDED batches; SEQUENCE_PARALLEL ids "
                "are captured by the router (route(..., capture=...)), which all-gathers them over TP"
            )
        return MoEDispatchConfig(
            max_num_tokens=self.rows_fed(_positive_int("max_num_tokens", max_num_tokens)),
            top_k=top_k,
            dp_size=self.dp_size,
            ep_size=self.ep_size,
            use_ep=self.use_ep,
            layout=self.layout,
        )


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's torch.distributed groups for a :class:`ParallelLayout`; build with :meth:`build`."""

    # the process layout the groups implement
    layout: ParallelLayout
    # global rank, in [0, world_size)
    rank: int
    # rank // tp_size: this rank's DP rank
    dp_rank: int
    # rank % tp_size: this rank's position in its TP group
    tp_rank: int
    # ranks {d * tp_size + tp_rank for every d}, group rank == DP rank
    dp_group: Any
    # ranks [dp_rank * tp_size, (dp_rank + 1) * tp_size), group rank == TP rank
    tp_group: Any
    # every rank, group rank == global rank (DP-then-TP)
    ep_group: Any
    # every rank on a CPU (gloo) backend: the plan's host exchange of shapes
    host_group: Any

    def __post_init__(self) -> None:
        if not isinstance(self.layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout, got {type(self.layout).__name__}")
        ranks = self.layout.ranks_of(self.rank)
        if (self.dp_rank, self.tp_rank) != ranks:
            raise ValueError(
                f"dp_rank and tp_rank must be {ranks} for rank {self.rank} of the layout (DP-major), "
                f"got ({self.dp_rank!r}, {self.tp_rank!r})"
            )
        layout = self.layout
        sizes = {
            "dp_group": layout.dp_size,
            "tp_group": layout.tp_size,
            "ep_group": layout.world_size,
            "host_group": layout.world_size,
        }
        for name, size in sizes.items():
            group = getattr(self, name)
            check_process_group(name, group, optional=False)
            if group.size() != size:
                raise ValueError(f"{name} must have {size} ranks for {layout}, got {group.size()}")

    @classmethod
    def build(cls, layout: ParallelLayout) -> ProcessGroups:
        """Creates the DP, TP and host groups of ``layout`` in the initialised default group.

        COLLECTIVE: every rank calls it, in the same order relative to its other group creations
        (``torch.distributed.new_group`` is collective). The host group is the default group when
        its backend is gloo, else a new gloo group over every rank. Every group gets the default
        group's timeout (``init_process_group(timeout=)``; ``new_group`` alone would give gloo
        groups 30 minutes), so a rank left waiting for a peer raises as it would in the default
        group. A backend that does not expose its timeout leaves torch's default, with a warning.

        The ranks first all-gather their layouts over the host group (four int64 per rank) and
        compare them, before creating any DP or TP group: ranks that disagree (another layout, or
        another ``dp_size x tp_size``) would create different groups and wait for each other.

        Raises ValueError when torch.distributed is not initialised (on the calling rank: nothing
        collective started), and on every rank alike when the ranks' layouts differ or the world
        size is not ``layout.world_size``.
        """
        import torch.distributed as dist

        if not isinstance(layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("torch.distributed is not initialised: call init_process_group first")
        world, rank = dist.get_world_size(), dist.get_rank()
        world_group = dist.group.WORLD
        timeout = _default_timeout(world_group)
        if timeout is None:
            warnings.warn(
                f"the default group's {dist.get_backend(world_group)} backend does not expose its "
                "timeout: the DP, TP and host groups get torch's default timeout for their backend",
                stacklevel=2,
            )
        # new_group is collective over the default group: every rank creates every group, in order.
        # The host group comes first: it is the same whatever the layout, and the layouts travel on it.
        options = {} if timeout is None else {"timeout": timeout}
        if dist.get_backend(world_group) == "gloo":
            host_group = world_group
        else:
            host_group = dist.new_group(list(range(world)), backend="gloo", **options)
        _check_layouts(_host_all_gather(_layout_fields(layout), host_group), "ProcessGroups.build")
        if world != layout.world_size:
            raise ValueError(
                f"the layout needs dp_size * tp_size = {layout.dp_size} * {layout.tp_size} = "
                f"{layout.world_size} processes, the default group has {world}"
            )
        dp, tp = layout.dp_size, layout.tp_size
        dp_rank, tp_rank = divmod(rank, tp)
        tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp)), **options) for d in range(dp)]
        dp_groups = [dist.new_group([d * tp + t for d in range(dp)], **options) for t in range(tp)]
        return cls(
            layout=layout,
            rank=rank,
            dp_rank=dp_rank,
            tp_rank=tp_rank,
            dp_group=dp_groups[tp_rank],
            tp_group=tp_groups[dp_rank],
            ep_group=world_group,
            host_group=host_group,
        )


@dataclass(frozen=True)
class StepPlan:
    """The host-side shapes of a step, the same on every rank; from :meth:`DistributedStep.plan`.

    Reuse a plan for every step with the same padded rows (one per CUDA-graph size): it holds no
    per-step value.
    """

    # the process layout the plan was made for
    layout: ParallelLayout
    # this rank's DP rank, index into padded
    dp_rank: int
    # padded[d]: rows of DP rank d's padded batch (>= its real count), DP order
    padded: tuple[int, ...]
    # rows this rank's tensors have entering the MoE layer: padded[dp_rank], or its SP chunk
    local_rows: int
    # GATHERED: padded; SHARDED: dp_size * tp_size SP chunks ceil(padded[d] / tp), DP-then-TP
    # (vLLM's local_sizes); () for LOCAL and SEQUENCE_PARALLEL
    local_sizes: tuple[int, ...]
    # rows the router sees on this rank: sum(local_sizes) when dispatched, else local_rows
    routed_rows: int
    # (1,) int32 on the capture device: padded[dp_rank], sent beside the count by begin()
    rows_tensor: torch.Tensor = field(repr=False, compare=False)


def _dispatch_limits(dispatch: MoEDispatchConfig | None) -> tuple[int, int]:
    if dispatch is None:
        return _INVALID, _INVALID
    return dispatch.max_num_tokens, dispatch.scratch_rows


def _all_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gathers ``x`` along dim 0 over ``group`` with functional collectives (traced by
    torch.compile, capturable in CUDA graphs with NCCL)."""
    from torch.distributed import _functional_collectives as funcol

    # all_gather_single replaces all_gather_tensor in torch 2.13; 2.11 only has the latter.
    all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    out = all_gather(x.contiguous(), gather_dim=0, group=group)
    if isinstance(out, funcol.AsyncCollectiveTensor):
        out = out.wait()
    return out


def _all_gatherv(x: torch.Tensor, sizes: tuple[int, ...], group: Any) -> torch.Tensor:
    """vLLM's ``all_gatherv``: every group rank's ``x`` of ``sizes[rank]`` rows, concatenated in
    group-rank order, ``sum(sizes)`` rows.

    ``sizes`` are host shapes every rank agrees on (the plan). Uneven sizes are padded to the
    largest, all-gathered in one collective and cut back with static slices (one extra copy of
    the gathered rows); equal sizes, the CUDA-graph case, are one all-gather and nothing else.
    """
    largest = max(sizes)
    if largest == 0:  # every rank agrees (same plan): nobody enters a collective
        return x.new_empty((0, *x.shape[1:]))
    if x.shape[0] < largest:
        x = torch.cat([x, x.new_zeros((largest - x.shape[0], *x.shape[1:]))])
    gathered = _all_gather(x, group)
    if all(s == largest for s in sizes):
        return gathered
    return torch.cat([gathered[i * largest : i * largest + s] for i, s in enumerate(sizes)])


# a count above its rank's padded rows is one clamped call with this bit, as the capture records it
_CLAMP_SLOT = FAULT_SLOT[FAULT_SOURCE_SHORT]


def _clamp_counts(
    counts: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, errors: torch.Tensor, dp_rank: int
) -> None:
    """``out = min(counts, rows)``; when ``counts[dp_rank] > rows[dp_rank]``, one clamped call with
    FAULT_SOURCE_SHORT in the capture fault counter ``errors`` (its row window would otherwise run
    into the next rank's rows, which the capture cannot tell from its own).

    On the device, no host read; the counter update is an atomic ``index_add_`` on CUDA and takes
    the CPU counters' lock on the CPU, as the capture kernels' updates do.
    """
    torch.minimum(counts, rows, out=out)
    over = (counts[dp_rank] > rows[dp_rank]).to(torch.int32).reshape(1).expand(2).contiguous()
    slots = torch.arange(2, device=errors.device) * _CLAMP_SLOT  # [0, slot] without a host copy
    with cpu_counter_lock(errors.device):
        errors.index_add_(0, slots, over)


# one device-neutral body for every device (registered for CUDA, and for the CPU through cpu=None)
clamp_counts_op = destination_op("clamp_counts_", mutates=("out", "errors"), cuda=_clamp_counts)


class DistributedStep:
    """One rank's routing step in a process layout: count exchange, dispatch, routing and capture.

    Args:
        groups: this rank's :class:`ProcessGroups`.
        capturer: this rank's ``moe_ops.RoutingCapturer``, on the device the groups' backend
            serves (CPU for gloo, this rank's GPU for NCCL), with ``dp_size`` and ``dp_rank`` of
            the layout and ``shards_per_rank == groups.layout.shards_per_rank``.
        dispatch: the ``MoEDispatchConfig`` of the layer's monolithic experts, if any: every plan
            then checks that each rank's rows and the dispatched batch fit its routing-replay
            scratch. Its ``dp_size``, ``ep_size``, ``use_ep`` and ``layout`` must be the layout's
            (:meth:`ParallelLayout.dispatch_config` builds it).

    Raises ValueError (TypeError for wrong types) naming the argument; nothing is allocated then.

    Thread safety: a step object belongs to the thread that drives its rank's steps (the
    collectives of one rank must be issued in one order).
    """

    def __init__(self, groups: ProcessGroups, capturer: Any, *, dispatch: MoEDispatchConfig | None = None):
        if not isinstance(groups, ProcessGroups):
            raise TypeError(f"groups must be ProcessGroups, got {type(groups).__name__}")
        layout = groups.layout
        missing = [n for n in _CAPTURER_FIELDS if not hasattr(capturer, n)]
        if missing:
            raise TypeError(
                f"capturer must be a moe_ops.RoutingCapturer; {type(capturer).__name__} lacks "
                f"{', '.join(missing)}"
            )
        if capturer.dp_size != layout.dp_size or capturer.dp_rank != groups.dp_rank:
            raise ValueError(
                f"capturer must have dp_size={layout.dp_size} and dp_rank={groups.dp_rank} (this rank's), "
                f"got dp_size={capturer.dp_size} and dp_rank={capturer.dp_rank}"
            )
        if capturer.shards_per_rank != layout.shards_per_rank:
            raise ValueError(
                f"capturer must have shards_per_rank={layout.shards_per_rank} for {layout.layout.name} "
                f"with tp_size={layout.tp_size}, got {capturer.shards_per_rank}"
            )
        if dispatch is not None:
            if not isinstance(dispatch, MoEDispatchConfig):
                raise TypeError(
                    f"dispatch must be a MoEDispatchConfig or None, got {type(dispatch).__name__}"
                )
            want = {
                "dp_size": layout.dp_size,
                "ep_size": layout.ep_size,
                "use_ep": layout.use_ep,
                "layout": layout.layout,
            }
            wrong = {k: getattr(dispatch, k) for k, v in want.items() if getattr(dispatch, k) != v}
            if wrong:
                raise ValueError(
                    f"dispatch must describe this layout ({want}), got {wrong}: build it with "
                    "ParallelLayout.dispatch_config"
                )
            if dispatch.top_k != capturer.buffer.shape[2]:
                raise ValueError(
                    f"dispatch.top_k={dispatch.top_k} must be the capture buffer's top_k "
                    f"{capturer.buffer.shape[2]}"
                )
        import torch.distributed as dist

        backend = str(dist.get_backend(groups.dp_group))
        device_type = torch.device(capturer.device).type
        if (backend == "nccl" and device_type != "cuda") or (backend == "gloo" and device_type != "cpu"):
            raise ValueError(
                f"capturer must be on {'a CUDA device' if backend == 'nccl' else 'the CPU'} for the "
                f"{backend} backend of the groups, got {capturer.device}"
            )
        self.groups = groups
        self.layout = layout
        self.capturer = capturer
        self.dispatch_config = dispatch
        self.device = capturer.device

    # ------------------------------------------------------------------ host: shapes

    def plan(self, num_rows: int) -> StepPlan:
        """COLLECTIVE (host): shares every rank's padded rows and checks them on every rank.

        Args:
            num_rows: rows of this rank's DP batch this step, padding included (its CUDA-graph
                size, or its real count when unpadded). The TP ranks of one DP rank hold one batch
                and pass the same value.

        One all-gather of eight int64 per rank over the host group (``num_rows``, the capture
        buffer's ``max_num_tokens``, the dispatch config's two limits, the four fields of the
        layout), then pure host arithmetic: every rank checks the same numbers, so every rank
        raises the same ValueError (naming the rank and the limit) or none does, before any device
        collective of the step. Checks, in this order: every rank's step has the same
        :class:`ParallelLayout` (ranks that disagree would issue different collectives and wait
        for each other); ``num_rows`` is an int >= 0 on every rank; the TP ranks of each DP rank agree;
        each DP batch fits the capture buffer of each of its ranks (``max_num_tokens``: every real
        token may be among its rows); with ``dispatch``, each rank's rows entering the layer fit
        ``dispatch.max_num_tokens`` and the dispatched batch fits the scratch.
        """
        # checked without raising: a rank that raised here would leave the others in the all-gather
        valid = not isinstance(num_rows, bool) and isinstance(num_rows, int) and 0 <= num_rows <= _INT32_MAX
        fed_limit, scratch_rows = _dispatch_limits(self.dispatch_config)
        mine = [num_rows if valid else _INVALID, self.capturer.max_num_tokens, fed_limit, scratch_rows]
        table = _host_all_gather([*mine, *_layout_fields(self.layout)], self.groups.host_group)
        _check_layouts([row[len(mine) :] for row in table], "DistributedStep.plan")
        rows_of, buffer_of, fed_of, scratch_of = ([row[i] for row in table] for i in range(len(mine)))
        if not valid:
            raise ValueError(f"num_rows must be an int in [0, 2**31) (this batch's rows), got {num_rows!r}")
        padded = self._check_plan(rows_of, buffer_of, fed_of, scratch_of)
        layout = self.layout
        tp, dp_rank = layout.tp_size, self.groups.dp_rank
        local_rows = layout.rows_fed(padded[dp_rank])
        if layout.layout == BatchLayout.GATHERED:
            local_sizes = padded
        elif layout.layout == BatchLayout.SHARDED:
            local_sizes = tuple(_ceil_div(p, tp) for p in padded for _ in range(tp))
        else:
            local_sizes = ()
        return StepPlan(
            layout=layout,
            dp_rank=dp_rank,
            padded=padded,
            local_rows=local_rows,
            local_sizes=local_sizes,
            routed_rows=sum(local_sizes) if local_sizes else local_rows,
            rows_tensor=torch.tensor([padded[dp_rank]], dtype=torch.int32, device=self.device),
        )

    def _check_plan(self, rows_of, buffer_of, fed_of, scratch_of) -> tuple[int, ...]:
        """The plan's checks on the gathered table (same table, same outcome on every rank)."""
        layout = self.layout
        tp = layout.tp_size

        def who(rank: int) -> str:
            d, t = layout.ranks_of(rank)
            return f"rank {rank} (DP rank {d}, TP rank {t})"

        bad = [r for r, rows in enumerate(rows_of) if rows == _INVALID]
        if bad:
            raise ValueError(
                f"num_rows must be an int in [0, 2**31) on every rank; {', '.join(map(who, bad))} "
                "passed another value (raised on every rank)"
            )
        for d in range(layout.dp_size):
            group = rows_of[d * tp : (d + 1) * tp]
            if len(set(group)) > 1:
                raise ValueError(
                    f"the TP ranks of DP rank {d} hold one batch but passed different num_rows {group} "
                    "(raised on every rank)"
                )
        padded = tuple(rows_of[d * tp] for d in range(layout.dp_size))
        for r in range(layout.world_size):
            rows = rows_of[r]
            if rows > buffer_of[r]:
                raise ValueError(
                    f"{who(r)}: its batch of {rows} rows exceeds its capture buffer's "
                    f"max_num_tokens={buffer_of[r]} (raised on every rank)"
                )
        # rows of the batch the router sees after the dispatch (the same on every rank of the layout)
        if layout.layout == BatchLayout.GATHERED:
            dispatched = sum(padded)
        elif layout.layout == BatchLayout.SHARDED:
            dispatched = sum(tp * _ceil_div(p, tp) for p in padded)
        else:
            dispatched = None
        # the rank whose batch is too large first: it is the cause of a dispatched batch too large
        for r in range(layout.world_size):
            fed = layout.rows_fed(rows_of[r])
            if fed_of[r] != _INVALID and fed > fed_of[r]:
                raise ValueError(
                    f"{who(r)} feeds the MoE layer {fed} rows but its experts' dispatch config has "
                    f"max_num_tokens={fed_of[r]}: the routing-replay scratch holds {scratch_of[r]} rows "
                    f"(max_num_tokens x dispatch_group_size={layout.dispatch_group_size}); raise "
                    "max_num_tokens (raised on every rank)"
                )
        for r in range(layout.world_size):
            routed = dispatched if dispatched is not None else layout.rows_fed(rows_of[r])
            if scratch_of[r] != _INVALID and routed > scratch_of[r]:
                raise ValueError(
                    f"{who(r)}: the dispatched batch has {routed} rows but the routing-replay scratch "
                    f"holds {scratch_of[r]} rows (max_num_tokens={fed_of[r]} x dispatch_group_size="
                    f"{layout.dispatch_group_size}); raise max_num_tokens (raised on every rank)"
                )
        return padded

    # ------------------------------------------------------------------ device: counts

    def _check_plan_arg(self, plan: object) -> StepPlan:
        if not isinstance(plan, StepPlan):
            raise TypeError(f"plan must be a StepPlan from DistributedStep.plan, got {type(plan).__name__}")
        if plan.layout != self.layout or plan.dp_rank != self.groups.dp_rank:
            raise ValueError("plan was made for another layout or rank: use this step's plan()")
        return plan

    def exchange(self, plan: StepPlan, num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All-gathers every DP rank's real count over the DP group, on the device.

        Args:
            plan: this step's :class:`StepPlan`.
            num_tokens: (1,) int32 on the capture device - this rank's real tokens (rows
                ``[0, num_tokens)`` of its batch are real, the rest padding). Read on the device
                only: update it in place between CUDA-graph replays.

        Returns:
            token_counts: (dp_size,) int32 on the device - real tokens of each DP rank, each at most
                its padded rows: a count above them (a caller's bug: the rows hold the tokens) is
                clamped on the device and recorded in the capturer's fault counter (one clamped
                call, FAULT_SOURCE_SHORT), which ``capturer.check_errors`` reports.
            shard_sizes: the sizes the capture reads, computed on the device from the padded rows
                that travel with the counts: (dp_size,) int32 for GATHERED (each DP rank's padded
                rows), (dp_size * tp_size,) int32 for SHARDED (``ceil(padded / tp)`` per TP rank,
                DP-then-TP: vLLM's ``local_sizes``); None for LOCAL and SEQUENCE_PARALLEL.

        One all-gather of two int32 per DP rank (functional collectives: ``torch.compile`` traces
        it, NCCL captures it in a CUDA graph). No host read. Bad arguments raise ValueError on this
        rank only (they are host metadata, the same every step: the first step fails).
        """
        plan = self._check_plan_arg(plan)
        if (
            not isinstance(num_tokens, torch.Tensor)
            or num_tokens.shape != (1,)
            or num_tokens.dtype != torch.int32
            or num_tokens.device != self.device
        ):
            got = (
                f"{tuple(num_tokens.shape)} {num_tokens.dtype} on {num_tokens.device}"
                if isinstance(num_tokens, torch.Tensor)
                else type(num_tokens).__name__
            )
            raise ValueError(f"num_tokens must be a (1,) int32 tensor on {self.device}, got {got}")
        layout = self.layout
        pairs = _all_gather(torch.cat([num_tokens, plan.rows_tensor]), self.groups.dp_group)
        pairs = pairs.view(layout.dp_size, 2)
        counts, padded = torch.empty(layout.dp_size, dtype=torch.int32, device=self.device), pairs[:, 1]
        errors = self.capturer.fault_counter.tensor
        torch.ops.moe_ops.clamp_counts_(pairs[:, 0], padded, counts, errors, self.groups.dp_rank)
        if layout.layout == BatchLayout.GATHERED:
            return counts, padded
        if layout.layout == BatchLayout.SHARDED:
            tp = layout.tp_size
            chunks = torch.div(padded + (tp - 1), tp, rounding_mode="floor")
            return counts, chunks.repeat_interleave(tp)
        return counts, None

    def begin(self, plan: StepPlan, num_tokens: torch.Tensor, *, stream: Any = None) -> None:
        """Starts a step: :meth:`exchange`, then ``capturer.set_step(token_counts, shard_sizes)``.

        ``set_step`` takes the exchanged tensors as device tensors on CUDA (copied device to
        device, no host read); on a CPU capturer, the gloo case, they are host memory already and
        ``set_step`` validates them there. Call it on the forward's stream, before the forward.
        """
        counts, sizes = self.exchange(plan, num_tokens)
        self.capturer.set_step(counts, sizes, stream=stream)

    # ------------------------------------------------------------------ device: rows

    def shard(self, plan: StepPlan, batch: torch.Tensor) -> torch.Tensor:
        """This TP rank's rows of its DP rank's padded batch as the MoE layer takes them.

        batch: (padded[dp_rank], ...) - the DP rank's batch, real rows first. Returns it as is for
        LOCAL and GATHERED; for SHARDED and SEQUENCE_PARALLEL the SP chunk
        ``batch[t * k : (t + 1) * k]`` with ``k = ceil(padded / tp)``, zero rows past the batch.
        """
        plan = self._check_plan_arg(plan)
        rows = plan.padded[plan.dp_rank]
        if not isinstance(batch, torch.Tensor) or batch.dim() < 1 or batch.shape[0] != rows:
            shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
            raise ValueError(f"batch must have this DP rank's {rows} rows (the plan's), got {shape}")
        if self.layout.layout not in _SP_LAYOUTS:
            return batch
        k, t = plan.local_rows, self.groups.tp_rank
        chunk = batch[t * k : (t + 1) * k]
        if chunk.shape[0] < k:
            chunk = torch.cat([chunk, chunk.new_zeros((k - chunk.shape[0], *chunk.shape[1:]))])
        return chunk

    def dispatch(self, plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        """The naive dispatch: ``x`` (this rank's ``plan.local_rows`` rows) all-gathered over the DP
        group (GATHERED) or the EP group (SHARDED) into ``plan.routed_rows`` rows, vLLM's
        all-gatherv layout with ``plan.local_sizes``; ``x`` itself for LOCAL and SEQUENCE_PARALLEL.

        Functional collectives (traced by torch.compile); one all-gather, plus one copy of the
        gathered rows when the sizes are uneven. The caller dispatches whatever the experts need
        (hidden states, router logits) the same way.
        """
        plan = self._check_plan_arg(plan)
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != plan.local_rows:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have this rank's {plan.local_rows} rows (the plan's), got {shape}")
        if self.layout.layout == BatchLayout.GATHERED:
            return _all_gatherv(x, plan.local_sizes, self.groups.dp_group)
        if self.layout.layout == BatchLayout.SHARDED:
            return _all_gatherv(x, plan.local_sizes, self.groups.ep_group)
        return x

    def route(
        self,
        plan: StepPlan,
        layer: int,
        router_logits: torch.Tensor,
        top_k: int,
        method: RoutingMethod | int = RoutingMethod.RENORMALIZE,
        **route_kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatches ``router_logits``, routes them and captures this DP rank's real rows.

        Args:
            plan: this step's :class:`StepPlan` (after :meth:`begin`).
            layer: the MODEL layer index (``capturer.target`` maps it to a buffer column).
            router_logits: (plan.local_rows, num_experts) float - this rank's rows entering the
                layer (:meth:`shard` cuts them for the SP layouts).
            top_k, method, route_kwargs: as ``moe_ops.route`` (``bias``, ``n_group``, ...).

        Returns ``route``'s ``(weights, ids)`` of the ``plan.routed_rows`` rows the router saw (the
        dispatched batch for GATHERED and SHARDED). The capture runs in the router's kernel, except
        SEQUENCE_PARALLEL's, which all-gathers the ids over the TP group first. Every DP rank's
        capture buffer receives exactly its own real tokens' ids: the rows come from the live
        counts of :meth:`begin`, on the device.
        """
        logits = self.dispatch(plan, router_logits)
        tp_group = self.groups.tp_group if self.layout.layout == BatchLayout.SEQUENCE_PARALLEL else None
        target = self.capturer.target(layer, self.layout.layout, tp_group=tp_group)
        return route(logits, top_k, method, capture=target, **route_kwargs)


# ---------------------------------------------------------------------------------------------------
# After the rollout: routing to a client, and to trainers in another split
# ---------------------------------------------------------------------------------------------------


def gather_routing(routing: np.ndarray, *, dst: int = 0, group: Any = None) -> list[np.ndarray] | None:
    """COLLECTIVE (host): every rank's routing, on ``dst`` as a client receives it.

    Each rank sends ``routing`` (an integer array, e.g. its ``(num_tokens, num_layers, top_k)``
    snapshot) as the base64 ``.npy`` text of ``moe_ops.encode_routing``, the ``routed_experts``
    format of serving engines; ``dst`` decodes them (``decode_routing``). Returns, on ``dst``, the
    arrays in group-rank order; None elsewhere. ``dst`` is a global rank.

    A rank whose ``routing`` cannot be encoded still takes part in the gather (nobody is left
    waiting), then raises ValueError; ``dst`` raises too, naming it. A ``group`` that is not a
    ``torch.distributed.ProcessGroup`` (or None: the default group) raises TypeError before the
    gather.
    """
    import torch.distributed as dist

    check_process_group("group", group)
    try:
        text, error = encode_routing(routing), None
    except (TypeError, ValueError) as exc:
        text, error = None, exc
    out: list[str | None] | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(text, out, dst=dst, group=group)
    if error is not None:
        raise ValueError(f"routing could not be sent: {error}") from error
    if out is None:
        return None
    bad = [i for i, t in enumerate(out) if t is None]
    if bad:
        raise ValueError(f"group ranks {bad} sent no routing (their arrays could not be encoded)")
    return [decode_routing(t) for t in out]


def scatter_routing(chunks: Sequence[np.ndarray] | None, *, src: int = 0, group: Any = None) -> np.ndarray:
    """COLLECTIVE (host): ``chunks[i]`` from ``src`` to group rank ``i``, in the wire format.

    On ``src``, ``chunks`` holds one integer array per group rank (a trainer's share of the
    routing, in the trainer's split); elsewhere it is ignored (pass None). Returns this rank's
    array. ``src`` is a global rank. Bad ``chunks`` (a wrong count, an array that cannot be
    encoded) raise ValueError on every rank: ``src`` still scatters, the reason instead of the
    arrays, so nobody is left waiting. A ``group`` that is not a ``torch.distributed.ProcessGroup``
    (or None: the default group) raises TypeError before the scatter.
    """
    import torch.distributed as dist

    check_process_group("group", group)
    world = dist.get_world_size(group)
    payload = None
    if dist.get_rank() == src:
        try:
            if chunks is None or len(chunks) != world:
                got = None if chunks is None else len(chunks)
                raise ValueError(f"chunks must hold one array per rank of the group ({world}), got {got}")
            payload = [("ok", encode_routing(c)) for c in chunks]
        except (TypeError, ValueError) as exc:
            payload = [("error", str(exc))] * world
    out: list[tuple[str, str] | None] = [None]
    dist.scatter_object_list(out, payload, src=src, group=group)
    status, text = out[0]
    if status != "ok":
        raise ValueError(f"scatter_routing on src rank {src}: {text}")
    return decode_routing(text)
