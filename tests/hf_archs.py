"""The transformers architectures the integration tests run, each skipped where the installed
transformers lacks its classes, or (for replay) is older than its replay needs, naming the version
that has them."""

from __future__ import annotations

import pytest

from moe_ops.integrations.hf import (
    MIN_REPLAY_TRANSFORMERS_VERSION,
    SUPPORTED_ARCHITECTURES,
    needs_release,
)

try:
    import transformers
except ImportError:  # the hf extra is optional; the test modules skip as a whole then
    transformers = None


def missing(arch: str, *, replay: bool = False) -> str | None:
    """Why ``arch`` cannot be built (or, with ``replay``, replayed) with the installed transformers,
    or None when it can."""
    if transformers is None:
        return None
    spec = SUPPORTED_ARCHITECTURES[arch]
    absent = [name for name in (spec.config_class, spec.model_class) if not hasattr(transformers, name)]
    if absent:
        return f"transformers {transformers.__version__} has no {', '.join(absent)}: {needs_release(arch)}"
    required = MIN_REPLAY_TRANSFORMERS_VERSION.get(arch)
    if replay and required is not None:
        from packaging.version import Version

        if Version(transformers.__version__) < Version(required):
            return (
                f"attach_replay of {arch} needs transformers>={required} (it refuses "
                f"{transformers.__version__}: older releases replay other ids)"
            )
    return None


def arch_param(arch: str, *values, id: str | None = None, replay: bool = False):
    """``pytest.param(arch, *values)``, skipped where the installed transformers lacks ``arch`` (with
    ``replay``: or is older than ``MIN_REPLAY_TRANSFORMERS_VERSION`` of ``arch``)."""
    reason = missing(arch, replay=replay)
    marks = [pytest.mark.skip(reason=reason)] if reason is not None else []
    return pytest.param(arch, *values, marks=marks, id=id)


# every supported architecture, as parameters
ARCH_PARAMS = [arch_param(arch, id=arch) for arch in SUPPORTED_ARCHITECTURES]
# the same, skipped where attach_replay refuses the installed transformers
REPLAY_PARAMS = [arch_param(arch, id=arch, replay=True) for arch in SUPPORTED_ARCHITECTURES]
# those the installed transformers has (for hypothesis, which cannot skip one draw)
AVAILABLE = [arch for arch in SUPPORTED_ARCHITECTURES if missing(arch) is None]
