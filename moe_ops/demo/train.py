"""The training half of ``moe-ops demo``: the rollout's routing replayed in one training step.

Per mode, after the rollout (``moe_ops.demo.serve`` with capture)::

    captured routing per request (num_tokens - 1, num_moe_layers, top_k)
      -> encode_routing -> text -> decode_routing          the wire, as a client receives it
      -> replay_batch (packed)    -> RoutingReplayer.set_batch
      -> the same model in float32 with autograd, attach_replay, router weights perturbed
         the way one optimizer step would (gate += lr * randn, seeded)
      -> routing_mismatch(recorded, live) per layer        without replay > 0, with replay 0
      -> loss.backward()                                   gradients reach the routers

and, with the unperturbed weights, the training logprobs of the generated tokens against the
rollout model's (float64) logprobs of the same tokens.

Then, once, :func:`routing_drift`: the same batch trained for a few Adam steps with replay, and
after each step the fraction of tokens whose experts the trainer's own router would pick differently
from the rollout's (what an RL trainer without replay trains on), against the replayed forward's
(always 0): ``routing_drift.png``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..models.reference import ReferenceMoEModel
from ..replay.metrics import routing_mismatch
from ..replay.replayer import RoutingReplayer, replay_batch
from ..shapes import RoutingShape
from ..wire import decode_routing, encode_routing

__all__ = [
    "LOGPROB_TOL",
    "RoutingDrift",
    "TrainCheck",
    "drift_figure",
    "format_checks",
    "perturb_routers",
    "plot_replay_mismatch",
    "plot_routing_drift",
    "replay_mismatch_figure",
    "routing_drift",
    "train_check",
    "training_model",
    "wire_round_trip",
]

# float32 training vs float64 rollout of the tiny preset: measured max |d logprob| 1.5e-6 over 102
# generated tokens (float32's 6e-8 relative rounding through 3 layers and a 128-way log-softmax);
# 1e-4 leaves ~60x room for other BLAS summation orders and thread counts.
LOGPROB_TOL = 1e-4


@dataclass
class TrainCheck:
    """One training step on the rollout's routing of one mode (see the module docstring)."""

    # the rollout's runner mode
    mode: str
    # requests packed into the batch, <= the model's max_requests
    requests: int
    # rows of the packed batch: sum of num_tokens over the requests
    rows: int
    # rows with a recorded routing (sum of num_tokens - 1): the tokens every mismatch counts
    recorded_rows: int
    # requests whose routing came back from the wire format different (must be 0)
    wire_mismatched: int
    # router weight perturbation: gate += lr * randn; lr >= 0
    lr: float
    # (num_moe_layers,) fraction of recorded rows whose expert set changed, perturbed, no replay
    changed: np.ndarray
    # (num_moe_layers,) fraction of recorded rows with no expert in common, perturbed, no replay
    disjoint: np.ndarray
    # (num_moe_layers,) fraction changed with replay, perturbed weights (must be exactly 0)
    replay_changed: np.ndarray
    # (num_moe_layers,) fraction changed with replay, unperturbed weights (must be exactly 0)
    replay_changed_unperturbed: np.ndarray
    # max |training logprob - rollout logprob| over generated tokens, unperturbed weights, >= 0
    logprob_max_abs_diff: float
    # generated tokens the logprobs were compared over, >= 1
    logprob_tokens: int
    # the step's loss (mean negative logprob of the generated tokens, replayed, perturbed); finite
    loss: float
    # L2 norm of the router gate gradients after backward; > 0 when gradients reach the routers
    router_grad_norm: float

    @property
    def problems(self) -> list[str]:
        """What failed; empty when the step checks out. (No routing change without replay is not
        a failure: it only means the perturbation was too small to show anything.)"""
        out = []
        if self.wire_mismatched:
            out.append(f"{self.wire_mismatched} requests changed through the wire format")
        if self.replay_changed.any() or self.replay_changed_unperturbed.any():
            out.append("replayed routing differs from the record")
        if not self.logprob_max_abs_diff <= LOGPROB_TOL:
            out.append(f"logprobs differ by {self.logprob_max_abs_diff:.2e} > {LOGPROB_TOL:.0e}")
        if not math.isfinite(self.loss):
            out.append(f"loss is {self.loss}")
        if not (math.isfinite(self.router_grad_norm) and self.router_grad_norm > 0):
            out.append(f"router gradient norm is {self.router_grad_norm}")
        return out


def wire_round_trip(routing: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Each request's routing encoded with :func:`~moe_ops.encode_routing` (base64 ``.npy`` text,
    what vLLM's ``routed_experts`` carries) and decoded with :func:`~moe_ops.decode_routing`.

    routing: req_id -> (num_tokens - 1, num_moe_layers, top_k) integer; ValueError naming the
        request for an array that is not 3-D.
    """
    for req_id, r in routing.items():
        if not isinstance(r, np.ndarray) or r.ndim != 3:
            raise ValueError(
                f"routing[{req_id}] must be a 3-D (num_tokens - 1, num_moe_layers, top_k) array, got "
                f"{getattr(r, 'shape', type(r).__name__)}"
            )
    return {req_id: decode_routing(encode_routing(r)) for req_id, r in routing.items()}


def training_model(model: ReferenceMoEModel) -> ReferenceMoEModel:
    """A float32 copy of ``model`` (same weights, rounded) whose parameters require grad."""
    config = dataclasses.replace(model.config, dtype=torch.float32)
    out = ReferenceMoEModel(config, device=model.embed.device)
    out.load_state_dict(model.state_dict())  # copy_ casts float64 -> float32
    out.requires_grad_(True)
    return out


def _check_lr(lr: object) -> None:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")


@torch.no_grad()
def perturb_routers(model: ReferenceMoEModel, lr: float, seed: int) -> None:
    """Adds ``lr * randn`` to every MoE router's gate weights in place, like one optimizer step.

    The noise is drawn on the CPU from a generator seeded with ``seed`` (the same numbers on every
    device and machine), one draw per MoE layer in layer order. ``lr`` must be a finite float >= 0.
    """
    _check_lr(lr)
    generator = torch.Generator().manual_seed(seed)
    for _, block in model.moe_blocks():
        gate = block.gate
        noise = torch.randn(gate.shape, generator=generator, dtype=torch.float64)
        gate.add_(noise.to(device=gate.device, dtype=gate.dtype), alpha=float(lr))


def _packed_inputs(sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """token_ids, positions, slot_ids: (sum(T),) int64 - request ``i`` in KV slot ``i``."""
    token_ids = [t for s in sequences for t in s]
    positions = [p for s in sequences for p in range(len(s))]
    slot_ids = [i for i, s in enumerate(sequences) for _ in s]
    return tuple(torch.tensor(v, dtype=torch.int64, device=device) for v in (token_ids, positions, slot_ids))


def _generated_logprobs(
    logits: torch.Tensor, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]
) -> torch.Tensor:
    """(G,) logprob of each generated token under the logits of the row before it (packed rows)."""
    rows, targets = [], []
    start = 0
    for s, p in zip(sequences, prompt_lens):
        rows += range(start + p - 1, start + len(s) - 1)
        targets += s[p:]
        start += len(s)
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    tgt = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    return F.log_softmax(logits[idx], dim=-1).gather(1, tgt[:, None])[:, 0]


@dataclass
class _TrainingBatch:
    """The packed batch of a training step (see :func:`train_check`'s steps 1-2)."""

    shape: RoutingShape
    device: torch.device
    # the packed requests' ids, in batch order
    ids: list[int]
    seqs: list[list[int]]
    prompts: list[int]
    # requests whose routing came back from the wire different
    wire_mismatched: int
    # (rows, num_moe_layers, top_k) int - replay_batch of the routing after the wire; -1 at last tokens
    batch: np.ndarray
    rows: int
    # batch on the device, and (rows,) bool - rows with a recorded routing
    recorded: torch.Tensor
    valid: torch.Tensor
    # token_ids, positions, slot_ids of the packed batch
    inputs: tuple[torch.Tensor, ...]


def _training_batch(
    model: ReferenceMoEModel,
    sequences: Mapping[int, Sequence[int]],
    routing: Mapping[int, np.ndarray],
    prompt_lens: Mapping[int, int],
    max_requests: int | None,
) -> _TrainingBatch:
    """Checks the arguments (ValueError naming the bad one, before any work), sends each request's
    routing through the wire format and packs the first ``max_requests`` requests."""
    cfg = model.config
    shape: RoutingShape = cfg.routing_shape()
    limit = cfg.max_requests if max_requests is None else max_requests
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= cfg.max_requests:
        raise ValueError(
            f"max_requests must be an int in [1, config.max_requests={cfg.max_requests}] or None, "
            f"got {max_requests!r}"
        )
    ids = sorted(set(sequences) & set(routing))[:limit]
    if not ids:
        raise ValueError("sequences and routing must share at least one req_id, got none in common")
    for req_id in ids:
        n, p = len(sequences[req_id]), prompt_lens.get(req_id)
        if p is None or not 1 <= p < n:
            raise ValueError(f"prompt_lens[{req_id}] must be in [1, {n}), got {p!r}")
    device = model.embed.device
    seqs = [list(sequences[i]) for i in ids]
    received = wire_round_trip({i: routing[i] for i in ids})
    wire_mismatched = sum(
        received[i].shape != routing[i].shape or bool((received[i] != routing[i]).any()) for i in ids
    )
    # (sum(T), L, K), -1 at last tokens; each request checked against its token count
    batch = replay_batch([received[i] for i in ids], shape, num_tokens=[len(s) for s in seqs])
    recorded = torch.from_numpy(batch).to(device)
    return _TrainingBatch(
        shape=shape,
        device=device,
        ids=ids,
        seqs=seqs,
        prompts=[prompt_lens[i] for i in ids],
        wire_mismatched=int(wire_mismatched),
        batch=batch,
        rows=batch.shape[0],
        recorded=recorded,
        valid=(recorded != -1).all(-1).all(-1),
        inputs=_packed_inputs(seqs, device),
    )


def train_check(
    model: ReferenceMoEModel,
    mode: str,
    sequences: Mapping[int, Sequence[int]],
    routing: Mapping[int, np.ndarray],
    prompt_lens: Mapping[int, int],
    *,
    lr: float = 0.01,
    seed: int = 0,
    max_requests: int | None = None,
) -> TrainCheck:
    """One training step of ``model`` (the rollout's model) on the routing a rollout recorded.

    Args:
        model: the rollout's :class:`ReferenceMoEModel` (not modified; a float32 copy trains).
        mode: the rollout's runner mode (a label).
        sequences: req_id -> the request's tokens, prompt + generated (``ServeResult.sequences``).
        routing: req_id -> (num_tokens - 1, num_moe_layers, top_k) integer - the captured routing
            (``ServeResult.routing``); sent through the wire format before use.
        prompt_lens: req_id -> prompt tokens of the request (>= 1, < num_tokens).
        lr: scale of the router perturbation (``gate += lr * randn``), a finite float >= 0.
        seed: seed of the perturbation.
        max_requests: requests packed into the batch (the lowest req_ids first); None: as many as
            the model has KV slots (``config.max_requests``).

    Host syncs: the metrics and the loss are read on the host.
    """
    _check_lr(lr)  # before any work: checked again where it is used
    b = _training_batch(model, sequences, routing, prompt_lens, max_requests)
    shape, device, ids, seqs, prompts = b.shape, b.device, b.ids, b.seqs, b.prompts
    batch, rows, recorded, valid, inputs = b.batch, b.rows, b.recorded, b.valid, b.inputs
    wire_mismatched = b.wire_mismatched

    with torch.no_grad():
        rollout_logprobs = _generated_logprobs(model(*inputs), seqs, prompts)

    train = training_model(model)
    replayer = RoutingReplayer(shape, rows, device)
    replayer.set_batch(batch)

    def mismatch(live: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        m = routing_mismatch(recorded, live, valid=valid)
        return m.changed.cpu().numpy(), m.disjoint.cpu().numpy()

    from ..integrations.hf import attach_replay

    with torch.no_grad(), attach_replay(train, replayer):
        logits, live = train(*inputs, return_router_ids=True)
        replay_unperturbed, _ = mismatch(live)
        diff = (_generated_logprobs(logits, seqs, prompts).double() - rollout_logprobs.double()).abs()

    perturb_routers(train, lr, seed)
    with torch.no_grad():
        _, live = train(*inputs, return_router_ids=True)
        changed, disjoint = mismatch(live)

    with attach_replay(train, replayer):
        logits, live = train(*inputs, return_router_ids=True)
        replay_changed, _ = mismatch(live.detach())
        loss = -_generated_logprobs(logits, seqs, prompts).mean()
        loss.backward()
    grads = [block.gate.grad for _, block in train.moe_blocks()]
    grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    return TrainCheck(
        mode=mode,
        requests=len(ids),
        rows=rows,
        recorded_rows=int(valid.sum()),
        wire_mismatched=int(wire_mismatched),
        lr=float(lr),
        changed=changed,
        disjoint=disjoint,
        replay_changed=replay_changed,
        replay_changed_unperturbed=replay_unperturbed,
        logprob_max_abs_diff=float(diff.max()),
        logprob_tokens=int(diff.numel()),
        loss=float(loss.detach()),
        router_grad_norm=grad_norm,
    )


def format_checks(checks: Sequence[TrainCheck], shape: RoutingShape) -> str:
    """The demo's table: per mode, mismatch per MoE layer without and with replay, logprobs."""
    layers = " ".join(f"L{layer}" for layer in shape.moe_layers)
    lines = [
        f"training step: the same model in float32 with autograd, router weights gate += "
        f"{checks[0].lr:g} * randn; routing of each request through encode_routing/decode_routing",
        f"{'mode':<20} {'reqs':>4} {'rows':>5}  changed/disjoint no replay ({layers})   "
        f"{'replay':>6}  {'max|dlogp|':>10}  result",
    ]
    for c in checks:
        per_layer = " ".join(f"{ch:.3f}/{dj:.3f}" for ch, dj in zip(c.changed, c.disjoint))
        replayed = float(max(c.replay_changed.max(), c.replay_changed_unperturbed.max()))
        problems = c.problems
        lines.append(
            f"{c.mode:<20} {c.requests:>4} {c.rows:>5}  {per_layer:<{26 + 4 * len(shape.moe_layers)}} "
            f"{replayed:>6g}  {c.logprob_max_abs_diff:>10.2e}  "
            + ("PASS" if not problems else "FAIL: " + "; ".join(problems))
        )
    lines.append(
        "(changed/disjoint: fraction of recorded tokens whose expert set changed / shares no expert "
        "with the record, live routing of the perturbed model; replay: the same with the recorded "
        "ids replayed (0 = every token got its recorded experts); max|dlogp|: unperturbed float32 "
        "training logprobs of the generated tokens vs the float64 rollout model's)"
    )
    return "\n".join(lines)


# Adam at 1e-3 for 10 steps on the demo's batch (tiny preset, 8 requests, 210 rows): the trainer's
# own routing leaves the rollout's step by step (0.12 / 0.20 of the tokens per MoE layer after one
# step, 0.42 / 0.62 after ten; measured), while the loss falls from 2.7 to 0.4. 1.5 s on 2 busy cores.
DRIFT_STEPS = 10
DRIFT_LR = 1e-3


@dataclass
class RoutingDrift:
    """The trainer's routing against the rollout's over training steps (see :func:`routing_drift`)."""

    # the rollout's runner mode (a label)
    mode: str
    # Adam's learning rate, > 0
    lr: float
    # rows with a recorded routing, the tokens each fraction counts
    recorded_rows: int
    # (steps + 1, num_moe_layers) fraction of recorded tokens whose expert set the trainer's own
    # router picks differently from the rollout's, before step 0 and after each step (no replay)
    changed: np.ndarray
    # (steps + 1, num_moe_layers) the same for the experts the replayed forward used (must be 0)
    replay_changed: np.ndarray
    # (steps + 1,) loss of the replayed forward (mean negative logprob of the generated tokens)
    loss: np.ndarray

    @property
    def steps(self) -> int:
        return self.changed.shape[0] - 1


def routing_drift(
    model: ReferenceMoEModel,
    mode: str,
    sequences: Mapping[int, Sequence[int]],
    routing: Mapping[int, np.ndarray],
    prompt_lens: Mapping[int, int],
    *,
    steps: int = DRIFT_STEPS,
    lr: float = DRIFT_LR,
    max_requests: int | None = None,
) -> RoutingDrift:
    """Trains a float32 copy of ``model`` for ``steps`` Adam steps on the rollout's batch with the
    recorded routing replayed (the loss: mean negative logprob of the generated tokens), and measures
    before the first step and after each: the trainer's own routing against the record (a forward
    without replay) and the replayed forward's.

    Arguments as :func:`train_check`'s; ``steps`` an int >= 1, ``lr`` a finite float > 0 (ValueError
    naming it, before any work). ``model`` is not modified.

    Host syncs: the metrics and the losses are read on the host, once per step.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    _check_lr(lr)
    if lr == 0:
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    b = _training_batch(model, sequences, routing, prompt_lens, max_requests)
    train = training_model(model)
    replayer = RoutingReplayer(b.shape, b.rows, b.device)
    replayer.set_batch(b.batch)
    optimizer = torch.optim.Adam(train.parameters(), lr=lr)
    from ..integrations.hf import attach_replay

    changed, replay_changed, losses = [], [], []
    for step in range(steps + 1):
        with torch.no_grad():
            _, live = train(*b.inputs, return_router_ids=True)
        changed.append(routing_mismatch(b.recorded, live, valid=b.valid).changed.cpu().numpy())
        with attach_replay(train, replayer):
            logits, used = train(*b.inputs, return_router_ids=True)
            m = routing_mismatch(b.recorded, used.detach(), valid=b.valid)
            replay_changed.append(m.changed.cpu().numpy())
            loss = -_generated_logprobs(logits, b.seqs, b.prompts).mean()
        losses.append(float(loss.detach()))
        if step == steps:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # the KV cache buffers hold this step's keys and values, with their autograd history
        for buffer in train.buffers():
            buffer.detach_()
    return RoutingDrift(
        mode=mode,
        lr=float(lr),
        recorded_rows=int(b.valid.sum()),
        changed=np.stack(changed),
        replay_changed=np.stack(replay_changed),
        loss=np.asarray(losses),
    )


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _missing(name: str) -> str:
    return f"matplotlib is not installed (pip install 'moe-ops[plot]'): skipped {name}"


def drift_figure(drift: RoutingDrift, shape: RoutingShape) -> Any:
    """The figure of ``routing_drift.png``: per MoE layer, the fraction of tokens whose experts differ
    from the rollout's, over training steps, without replay (solid) and with replay (dashed). Needs
    matplotlib (ImportError otherwise); close it with ``matplotlib.pyplot.close(fig)``."""
    plt = _pyplot()
    if plt is None:
        raise ImportError(_missing("routing_drift.png"))
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    x = np.arange(drift.steps + 1)
    for i, layer in enumerate(shape.moe_layers):
        (line,) = ax.plot(x, drift.changed[:, i], marker="o", label=f"layer {layer}, no replay")
        ax.plot(
            x,
            drift.replay_changed[:, i],
            linestyle="--",
            marker="x",
            color=line.get_color(),
            label=f"layer {layer}, replay",
        )
    ax.set_xlabel(f"training step (Adam, lr {drift.lr:g})")
    ax.set_ylabel("fraction of tokens")
    ax.set_ylim(0, 1)
    ax.set_xticks(x)
    ax.set_title(
        f"tokens whose experts differ from the rollout's "
        f"({drift.mode} rollout, {drift.recorded_rows} tokens)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_routing_drift(drift: RoutingDrift, shape: RoutingShape, path: str) -> str | None:
    """:func:`drift_figure` to ``path``; returns None, or a note when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return _missing("routing_drift.png")
    fig = drift_figure(drift, shape)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def replay_mismatch_figure(check: TrainCheck, shape: RoutingShape) -> Any:
    """The figure of ``replay_mismatch.png``: one pair of bars per MoE layer, the fraction of tokens
    whose experts changed after the router update, without and with replay. Needs matplotlib
    (ImportError otherwise); close it with ``matplotlib.pyplot.close(fig)``."""
    plt = _pyplot()
    if plt is None:
        raise ImportError(_missing("replay_mismatch.png"))
    x = np.arange(shape.num_layers)
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(5.5, 1.1 * shape.num_layers + 3), 3.8))
    pairs = (("no replay", check.changed, -width / 2), ("replay", check.replay_changed, width / 2))
    for label, values, offset in pairs:
        drawn = ax.bar(x + offset, values, width, label=label)
        ax.bar_label(drawn, fmt="%.2f", fontsize=8)  # a replay bar is 0: the label shows it is there
    ax.set_xticks(x)
    ax.set_xticklabels([str(layer) for layer in shape.moe_layers])
    ax.set_xlabel("MoE layer (model index)")
    ax.set_ylabel("fraction of tokens")
    ax.set_ylim(0, max(0.05, 1.15 * float(max(check.changed.max(), check.replay_changed.max()))))
    ax.set_title(
        f"tokens whose experts changed after a router update\n(gate += {check.lr:g} * randn, "
        f"{check.mode} rollout, {check.recorded_rows} tokens)",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_replay_mismatch(checks: Sequence[TrainCheck], shape: RoutingShape, path: str) -> str | None:
    """:func:`replay_mismatch_figure` of the last check (the mode whose ``routing.npz`` the demo
    writes; every mode's numbers are in the table) to ``path``; returns None, or a note when
    matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return _missing("replay_mismatch.png")
    fig = replay_mismatch_figure(checks[-1], shape)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
