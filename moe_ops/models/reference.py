"""A reference MoE transformer: small, readable, random-initialised, graph- and compile-friendly.

It is the model of the demo, the end-to-end tests and the end-to-end benchmark, and the template for
wiring capture into one's own model: each MoE block routes with ``moe_ops.route`` and records its
ids in the same call (``capture=capturer.target(layer_idx)``).

One step function serves prefill and decode (and mixed batches of both). Its inputs are flat token
rows, as a serving engine lays them out::

    row:         0     1     2     3     4     5     6     7
    token_ids:   t     t     t     t     t     t     0     0
    positions:   0     1     2     7     3     0     0     0
    slot_ids:    2     2     2     0     5     1     D     D      D = max_requests: the dummy slot
                 |<- prefill r2 ->|  decode decode  new  |<-pad->|

Every row writes its key/value into ``cache[slot_ids, positions]`` (a static per-request KV cache of
``max_requests + 1`` slots) and then attends to its own slot's positions ``<= positions``: dense masked
attention over ``max_seq_len``, simple and static-shaped. Padding rows (CUDA-graph padding) point at
the dummy slot, so they write and read only that slot and never touch a request's cache.

Experts: a simple, correct computation with static shapes, **not** a fast grouped GEMM
(``config.expert_impl``): ``"dense"`` runs every expert on every token and combines the outputs with
the routing weights (zero for experts a token did not choose); ``"gathered"`` gathers each (token, k)
pair's expert weights; ``"auto"`` gathers when a step has fewer pairs than experts
(``n * top_k < num_experts``, small decode batches). The choice depends only on the row count, so it
is fixed per CUDA graph and per compiled shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attach.replaying import ReplayRule
from ..capture.protocol import Capturer
from ..capture.target import CaptureTarget
from ..router import RoutingMethod, route
from ..router.args import validate_route_args
from ..router.methods import BIAS_METHODS
from ..router.op import BACKENDS
from ..router.reference import weights_for_ids

__all__ = ["PRESETS", "ReferenceMoEConfig", "ReferenceMoEModel", "reference_config"]

_RMS_EPS = 1e-6
EXPERT_IMPLS = ("dense", "gathered", "auto")


@dataclass(frozen=True)
class ReferenceMoEConfig:
    """Shape and routing of a :class:`ReferenceMoEModel`. Checked on construction."""

    # token ids are in [0, vocab_size); >= 2
    vocab_size: int = 128
    # width of the residual stream; a multiple of num_heads
    hidden_size: int = 64
    # attention heads; head size = hidden_size // num_heads
    num_heads: int = 4
    # decoder layers, dense and MoE together; > first_k_dense
    num_layers: int = 3
    # layers [0, first_k_dense) have a dense MLP, layers [first_k_dense, num_layers) a MoE block
    first_k_dense: int = 1
    # routed experts per MoE layer; >= top_k
    num_experts: int = 16
    # experts each token is routed to, in [1, num_experts]
    top_k: int = 4
    # how the router turns logits into (weights, ids); see docs/routing.md
    routing_method: RoutingMethod = RoutingMethod.DEEPSEEK_V3
    # DEEPSEEK_V3 expert groups (None: no grouping); divides num_experts
    n_group: int | None = 4
    # DEEPSEEK_V3 groups kept per token, in [1, n_group] (None with n_group None)
    topk_group: int | None = 2
    # routed_scaling_factor of every method's weights (None: 1.0)
    routed_scaling_factor: float | None = 2.5
    # DEEPSEEK_V3/MINIMAX2 only: the router has a selection bias (e_score_correction_bias)
    router_bias: bool = True
    # hidden width of one expert
    moe_intermediate_size: int = 32
    # hidden width of the dense MLP of the first_k_dense layers
    intermediate_size: int = 128
    # request slots of the KV cache (a step's rows belong to at most this many requests); >= 1
    max_requests: int = 8
    # positions per request, prompt and generated tokens together; >= 2
    max_seq_len: int = 64
    # seed of the random initialisation: equal configs give equal weights on one device type
    seed: int = 0
    # parameter and activation dtype; routing chooses on float32 logits (float64 models: the
    # weights of the chosen experts are computed from the float64 logits)
    dtype: torch.dtype = torch.float64
    # backend of moe_ops.route: "auto", "triton", "torch" or "flashinfer"
    router_backend: str = "auto"
    # expert computation: "gathered" (per (token, k) weight gather), "dense" (every expert on every
    # token), or "auto" (gathered when n * top_k < num_experts; a shape guard, so compiled steps with
    # a dynamic row count get one graph per side of it)
    expert_impl: str = "dense"

    def __post_init__(self) -> None:
        def positive(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

        for name, minimum in (
            ("vocab_size", 2),
            ("hidden_size", 1),
            ("num_heads", 1),
            ("num_layers", 1),
            ("num_experts", 1),
            ("top_k", 1),
            ("moe_intermediate_size", 1),
            ("intermediate_size", 1),
            ("max_requests", 1),
            ("max_seq_len", 2),
        ):
            positive(name, minimum)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size must be a multiple of num_heads={self.num_heads}, got {self.hidden_size}"
            )
        if (
            isinstance(self.first_k_dense, bool)
            or not isinstance(self.first_k_dense, int)
            or not 0 <= self.first_k_dense < self.num_layers
        ):
            raise ValueError(
                f"first_k_dense must be an int in [0, num_layers={self.num_layers}) (at least one MoE "
                f"layer), got {self.first_k_dense!r}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be <= num_experts={self.num_experts}, got {self.top_k}")
        if self.router_bias and RoutingMethod(self.routing_method) not in BIAS_METHODS:
            raise ValueError(
                f"router_bias=True needs a biased routing method (DEEPSEEK_V3 or MINIMAX2), got "
                f"{RoutingMethod(self.routing_method).name}"
            )
        # route()'s own checks of the routing arguments, on a (0, num_experts) stand-in
        validate_route_args(
            torch.empty(0, self.num_experts),
            self.top_k,
            self.routing_method,
            torch.zeros(self.num_experts) if self.router_bias else None,
            self.n_group,
            self.topk_group,
            self.routed_scaling_factor,
        )
        if self.router_backend not in BACKENDS:
            raise ValueError(
                f"router_backend must be one of {', '.join(map(repr, BACKENDS))}, got {self.router_backend!r}"
            )
        if self.expert_impl not in EXPERT_IMPLS:
            raise ValueError(
                f"expert_impl must be one of {', '.join(EXPERT_IMPLS)}, got {self.expert_impl!r}"
            )
        if self.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float64, float32, bfloat16 or float16, got {self.dtype}")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Model-layer indices of the MoE layers, in order."""
        return tuple(range(self.first_k_dense, self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense

    @property
    def dummy_slot(self) -> int:
        """The KV slot of padding rows: ``max_requests`` (one past the request slots)."""
        return self.max_requests

    def routing_shape(self):
        """The :class:`~moe_ops.RoutingShape` of this model (MoE layers only on the layer axis)."""
        from ..shapes import RoutingShape

        return RoutingShape(
            num_layers=self.num_moe_layers,
            num_experts=self.num_experts,
            top_k=self.top_k,
            moe_layers=self.moe_layers,
            num_model_layers=self.num_layers,
        )


PRESETS: dict[str, ReferenceMoEConfig] = {
    # CPU demo and tests: DeepSeek-V3-style routing (groups, bias, one dense layer first) at toy size.
    # float64 so that eager, compiled and graphed runs agree on every routing decision (see
    # docs/demo.md: float32 kernels of different modes round differently and can flip near-ties).
    "tiny": ReferenceMoEConfig(),
    # Benchmark: shaped like a small DeepSeek-V3 (8 MoE layers after one dense layer, 256 experts,
    # top-8, 8 groups keep 4, scale 2.5, bias, hidden 2048), bf16.
    "deepseek_small": ReferenceMoEConfig(
        vocab_size=8192,
        hidden_size=2048,
        num_heads=16,
        num_layers=9,
        first_k_dense=1,
        num_experts=256,
        top_k=8,
        routing_method=RoutingMethod.DEEPSEEK_V3,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        router_bias=True,
        moe_intermediate_size=256,
        intermediate_size=4096,
        max_requests=128,
        max_seq_len=128,
        dtype=torch.bfloat16,
        # decode at batch 1 and 16 gathers its 8 and 128 experts' weights instead of reading all 256
        expert_impl="auto",
    ),
}


def reference_config(name: str, **overrides: Any) -> ReferenceMoEConfig:
    """A preset (``"tiny"``, ``"deepseek_small"``) with fields replaced by ``overrides``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return dataclasses.replace(PRESETS[name], **overrides)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _RMS_EPS) * weight


class _Init:
    """Seeded normal initialisation on the target device (one generator, drawn in module order)."""

    def __init__(self, config: ReferenceMoEConfig, device: torch.device):
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        self.device = device
        self.dtype = config.dtype

    def normal(self, *shape: int, std: float, dtype: torch.dtype | None = None) -> nn.Parameter:
        t = torch.empty(shape, device=self.device, dtype=dtype or self.dtype)
        t.normal_(0.0, std, generator=self.generator)
        return nn.Parameter(t, requires_grad=False)

    def ones(self, *shape: int) -> nn.Parameter:
        return nn.Parameter(torch.ones(shape, device=self.device, dtype=self.dtype), requires_grad=False)


class _Attention(nn.Module):
    """Causal attention of each row over its own request's cached positions ``<= position``.

    cache_k, cache_v: (max_requests + 1, max_seq_len, num_heads, head_dim) dtype - KV cache, slot
        ``max_requests`` is the dummy slot of padding rows
    """

    def __init__(self, config: ReferenceMoEConfig, init: _Init):
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = h // config.num_heads
        self.norm = init.ones(h)
        self.w_qkv = init.normal(h, 3 * h, std=h**-0.5)
        self.w_o = init.normal(h, h, std=h**-0.5)
        cache_shape = (config.max_requests + 1, config.max_seq_len, self.num_heads, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(cache_shape, device=init.device, dtype=config.dtype))
        self.register_buffer("cache_v", torch.zeros(cache_shape, device=init.device, dtype=config.dtype))
        self.register_buffer("seq_index", torch.arange(config.max_seq_len, device=init.device))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (_rms_norm(x, self.norm) @ self.w_qkv).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # Write this step's keys/values first: a prefill row must see the rows before it in the step.
        self.cache_k[slot_ids, positions] = k
        self.cache_v[slot_ids, positions] = v
        keys = self.cache_k[slot_ids]  # (n, max_seq_len, heads, head_dim)
        values = self.cache_v[slot_ids]
        scores = torch.einsum("nhd,nshd->nhs", q, keys) * (self.head_dim**-0.5)
        visible = self.seq_index[None, :] <= positions[:, None]  # (n, max_seq_len)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out = torch.einsum("nhs,nshd->nhd", scores.softmax(-1), values).reshape(n, -1)
        return out @ self.w_o


class _DenseMLP(nn.Module):
    def __init__(self, config: ReferenceMoEConfig, init: _Init):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.norm = init.ones(h)
        self.w_gate_up = init.normal(h, 2 * i, std=h**-0.5)
        self.w_down = init.normal(i, h, std=i**-0.5)

    def forward(self, x: torch.Tensor, capture: CaptureTarget | None = None) -> tuple[torch.Tensor, None]:
        gate, up = (_rms_norm(x, self.norm) @ self.w_gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_down, None


class _MoEBlock(nn.Module):
    """Router (``moe_ops.route``, capturing when given a target) and routed experts.

    :meth:`router` is the replay hook: ``attach_replay`` wraps it on the instance, so the experts
    get the recorded ids, weighted from the live logits by :meth:`replay_rule`.

    gate: (hidden, num_experts) router weights, float32 (float64 in float64 models)
    bias: (num_experts,) float32 selection bias, or None
    w_gate_up: (num_experts, hidden, 2 * moe_intermediate_size) dtype
    w_down: (num_experts, moe_intermediate_size, hidden) dtype
    """

    def __init__(self, config: ReferenceMoEConfig, init: _Init):
        super().__init__()
        h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.config = config
        router_dtype = torch.float64 if config.dtype == torch.float64 else torch.float32
        self.norm = init.ones(h)
        self.gate = init.normal(h, e, std=h**-0.5, dtype=router_dtype)
        self.bias = init.normal(e, std=0.1, dtype=torch.float32) if config.router_bias else None
        self.w_gate_up = init.normal(e, h, 2 * i, std=h**-0.5)
        self.w_down = init.normal(e, i, h, std=i**-0.5)

    @property
    def top_k(self) -> int:
        """Experts per token (the router contract's ``top_k``, checked by ``attach_replay``)."""
        return self.config.top_k

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    def router(
        self, x: torch.Tensor, capture: CaptureTarget | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(router_logits, weights, ids)`` of the normalised hidden states ``x``, the contract of
        the transformers routers: :func:`moe_ops.models.attach_replay` replaces this method on the
        instance.

        router_logits: (n, num_experts) float32 (float64 in float64 models)
        weights: (n, top_k) float32 - ``moe_ops.route``'s weights
        ids: (n, top_k) int32 - the chosen experts, recorded into ``capture`` when given
        """
        cfg = self.config
        # Router logits in float32 (DeepSeek-V3 computes its gate in float32 too); moe_ops.route takes
        # float32/bf16/fp16.
        logits = x.to(self.gate.dtype) @ self.gate
        weights, ids = route(
            logits.to(torch.float32),
            cfg.top_k,
            cfg.routing_method,
            bias=self.bias,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            capture=capture,
            backend=cfg.router_backend,
        )
        return logits, weights, ids

    def replay_rule(self) -> ReplayRule:
        """How :func:`moe_ops.models.attach_replay` weights the recorded ids: this block's own
        routing method."""
        cfg = self.config
        return ReplayRule(
            RoutingMethod(cfg.routing_method),
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            bias_attr="bias" if cfg.router_bias else None,
            capture_kwarg="capture",
            description=f"moe_ops.route's {RoutingMethod(cfg.routing_method).name} weights",
        )

    def forward(
        self, x: torch.Tensor, capture: CaptureTarget | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        scale = 1.0 if cfg.routed_scaling_factor is None else cfg.routed_scaling_factor
        x = _rms_norm(x, self.norm)
        logits, weights, ids = self.router(x, capture=capture)
        if logits.dtype == torch.float64:
            # float64 models: the weights of the chosen experts from the float64 logits, so that the
            # residual stream keeps float64 precision (float32 weights would add ~1e-7 noise that
            # differs between batch layouts and modes, and could flip a later near-tie).
            weights = weights_for_ids(logits, ids.long(), RoutingMethod(cfg.routing_method), scale)
        weights = weights.to(x.dtype)
        impl = cfg.expert_impl
        if impl == "auto":
            impl = "gathered" if x.shape[0] * cfg.top_k < cfg.num_experts else "dense"
        out = self._gathered(x, weights, ids) if impl == "gathered" else self._dense(x, weights, ids)
        return out, ids

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, k) pair gathers its expert's weights: n * top_k expert weight reads."""
        idx = ids.long()
        h = torch.einsum("nd,nkdf->nkf", x, self.w_gate_up[idx])
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("nkf,nkfd->nkd", F.silu(gate) * up, self.w_down[idx])
        return (y * weights[..., None]).sum(1)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, combined with the routing weights (0 where not chosen)."""
        h = torch.einsum("nd,edf->enf", x, self.w_gate_up)
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("enf,efd->end", F.silu(gate) * up, self.w_down)
        combine = torch.zeros(x.shape[0], self.config.num_experts, device=x.device, dtype=x.dtype)
        combine.scatter_(1, ids.long(), weights)
        return torch.einsum("end,ne->nd", y, combine)


class _Layer(nn.Module):
    def __init__(self, config: ReferenceMoEConfig, init: _Init, moe: bool):
        super().__init__()
        self.attn = _Attention(config, init)
        self.mlp = _MoEBlock(config, init) if moe else _DenseMLP(config, init)


class ReferenceMoEModel(nn.Module):
    """Embedding, ``num_layers`` x (attention + dense MLP or MoE block), final norm, LM head.

    Args:
        config: a :class:`ReferenceMoEConfig` (see :data:`PRESETS`).
        device: where the weights and the KV cache live.

    The KV caches are module buffers marked as static addresses (inductor's CUDA-graph trees accept
    their in-place updates). Parameters do not require grad (a serving model); to train with
    replayed routing (:func:`moe_ops.models.attach_replay`, which ``moe_ops.attach_replay`` hands
    this model to; see :meth:`replay_routers`), call ``requires_grad_()`` on the parameters to train.
    """

    def __init__(self, config: ReferenceMoEConfig, device: torch.device | str = "cpu"):
        super().__init__()
        if not isinstance(config, ReferenceMoEConfig):
            raise TypeError(f"config must be a ReferenceMoEConfig, got {type(config).__name__}")
        device = torch.device(device)
        self.config = config
        init = _Init(config, device)
        h = config.hidden_size
        self.embed = init.normal(config.vocab_size, h, std=1.0)
        self.pos_embed = init.normal(config.max_seq_len, h, std=0.5)
        self.layers = nn.ModuleList(
            _Layer(config, init, moe=i >= config.first_k_dense) for i in range(config.num_layers)
        )
        self.final_norm = init.ones(h)
        self.lm_head = init.normal(h, config.vocab_size, std=h**-0.5)
        for layer in self.layers:
            torch._dynamo.mark_static_address(layer.attn.cache_k)
            torch._dynamo.mark_static_address(layer.attn.cache_v)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        *,
        capturer: Capturer | None = None,
        return_router_ids: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One step over flat token rows (prefill, decode or both).

        Args:
            token_ids: (n,) int64 - the token of each row, in [0, vocab_size).
            positions: (n,) int64 - its position in its request, in [0, max_seq_len).
            slot_ids: (n,) int64 - its request's KV slot, in [0, max_requests); padding rows use
                ``config.dummy_slot``. Rows of one request in one step have distinct positions.
            capturer: a :class:`~moe_ops.capture.Capturer` (``moe_ops.RoutingCapturer``; only its
                ``target(model_layer_index)`` is called): each MoE layer records its ids through
                ``route(..., capture=capturer.target(layer_idx))``. None: no capture.
            return_router_ids: also return the ids every MoE layer chose.

        Returns:
            logits: (n, vocab_size) float32 (float64 in float64 models) - next-token logits per row.
            router_ids: (n, num_moe_layers, top_k) int32 - only with ``return_router_ids``.

        Device values are not checked (no host reads): out-of-range ids, positions or slots are
        the caller's error.
        """
        x = self.embed[token_ids] + self.pos_embed[positions]
        all_ids = []
        for layer_idx, layer in enumerate(self.layers):
            x = x + layer.attn(x, positions, slot_ids)
            is_moe = layer_idx >= self.config.first_k_dense
            target = capturer.target(layer_idx) if capturer is not None and is_moe else None
            out, ids = layer.mlp(x, target)
            x = x + out
            if ids is not None:
                all_ids.append(ids)
        logits = _rms_norm(x, self.final_norm) @ self.lm_head
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if return_router_ids:
            return logits, torch.stack(all_ids, dim=1)
        return logits

    def moe_blocks(self) -> list[tuple[int, nn.Module]]:
        """``(model layer, MoE block)`` of every MoE layer, in layer order; a block's ``gate``
        ((hidden, num_experts) parameter) is its router's weight."""
        return [(i, layer.mlp) for i, layer in enumerate(self.layers) if isinstance(layer.mlp, _MoEBlock)]

    def replay_routers(self) -> list[tuple[int, str, nn.Module, str, ReplayRule]]:
        """The MoE blocks :func:`moe_ops.models.attach_replay` wraps: ``(model layer, module path,
        block, "router", rule)`` per MoE layer, in layer order. The block's ``router`` method is
        replaced on the instance; the rule is the block's own routing method (and bias, groups,
        scale)."""
        return [
            (i, f"layers.{i}.mlp", block, "router", block.replay_rule()) for i, block in self.moe_blocks()
        ]

    def set_router_backend(self, backend: str) -> None:
        """Routes with ``backend`` from now on (steps traced or captured before keep theirs)."""
        config = dataclasses.replace(self.config, router_backend=backend)
        self.config = config
        for _, block in self.moe_blocks():
            block.config = config

    def reset_cache(self) -> None:
        """Zeroes every KV cache (not needed between requests: stale positions are never read)."""
        for layer in self.layers:
            layer.attn.cache_k.zero_()
            layer.attn.cache_v.zero_()

    def extra_repr(self) -> str:
        c = self.config
        n_params = sum(p.numel() for p in self.parameters())
        return (
            f"layers={c.num_layers} (dense {c.first_k_dense}), experts={c.num_experts}, top_k={c.top_k}, "
            f"method={RoutingMethod(c.routing_method).name}, hidden={c.hidden_size}, "
            f"params={n_params / 1e6:.1f}M, dtype={c.dtype}"
        )
