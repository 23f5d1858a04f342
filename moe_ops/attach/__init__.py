"""Attaching to a model's routers: what capture and replay share, for every integration.

Each ``attach_*`` (transformers' in :mod:`moe_ops.integrations.hf`, Megatron-Core's in
:mod:`moe_ops.integrations.megatron`, the reference model's in :mod:`moe_ops.models.attach`) finds
its routers, checks them, replaces one attribute per router with a wrapper and returns a handle
that restores them. The three modules here, imported by name (this package imports none of them,
so that a capture loads nothing of replay):

- :mod:`~moe_ops.attach.sites`: the plumbing both sides share - :class:`RouterSite` (where a
  wrapper goes), the marks a wrapper carries (``CAPTURE_MARK``, ``REPLAY_MARK``), the checks made
  before any router is touched (``check_against_shape``, ``check_device``), ``attach_wrappers``
  and :class:`AttachHandle`.
- :mod:`~moe_ops.attach.capturing`: the capturing router wrapper (``capturing_forward``: the
  router's ids also go to a capturer), its check and :class:`CaptureHandle`.
- :mod:`~moe_ops.attach.replaying`: the replaying router wrapper (:class:`ReplayRule`,
  ``replay_router_output``, ``replaying_forward``), its checks and :class:`ReplayHandle`.

Nothing here imports an integration; the integrations import this.
"""
