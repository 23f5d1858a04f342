"""moe_ops.backends(): the report, the CLI subcommand, FlashInfer's device checks; ``import moe_ops``
does not import flashinfer."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import moe_ops
from moe_ops.cli import main
from moe_ops.flashinfer import SPECS
from moe_ops.flashinfer.backends import Support, fused_topk_support, kernel_support, trtllm_moe_support
from moe_ops.router.policy import routing_backend

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
_INSTALL_HINT = "flashinfer not installed (pip install 'moe-ops[flashinfer]')"
needs_flashinfer = pytest.mark.skipif(
    not HAS_FLASHINFER, reason="flashinfer-python is not installed (moe-ops[flashinfer])"
)


def test_import_moe_ops_does_not_import_flashinfer():
    code = "import sys, moe_ops, moe_ops.flashinfer; sys.exit('flashinfer' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"import moe_ops imported flashinfer: {result.stderr}"


def test_the_report_leaves_moe_ops_backends_a_function_and_loads_flashinfer_on_call_only():
    """The report lives in moe_ops.backend_report: importing it, or reading moe_ops.backends, imports
    nothing of moe_ops.flashinfer (so registers no FlashInfer op), and moe_ops.backends stays the
    function (a submodule named moe_ops.backends would replace it on the package once imported)."""
    code = (
        "import sys, moe_ops, moe_ops.backend_report\n"
        "report = moe_ops.backends\n"
        "print(callable(report), sorted(m for m in sys.modules if m.startswith('moe_ops.flashinfer')))\n"
        "report('cpu')\n"
        "print('moe_ops.flashinfer.ops' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["True []", "True"], result.stdout


@pytest.mark.parametrize("name", list(SPECS))
def test_kernel_support_answers_for_every_wrapped_function(name):
    """Every op of the table is gated (kernel_support reads no table of the ops: its name rule must
    cover them all); which device list gates which kernel shows on a GPU (test_report_on_the_gpu)."""
    support = kernel_support(name, "cpu")
    assert isinstance(support, Support) and not support.ok
    assert support.reason in ("needs a CUDA device, asked about cpu", _INSTALL_HINT), support.reason


@pytest.mark.parametrize("name", ["fused_topk", "trtllm_bf16", "moe", 3])
def test_kernel_support_refuses_other_names(name):
    with pytest.raises(ValueError, match="name must be fused_topk_deepseek or a trtllm_\\*_moe function"):
        kernel_support(name)


def test_report_lists_every_kernel_and_deepseek_routing():
    report = moe_ops.backends()
    assert [line.subject for line in report.kernels] == list(SPECS)
    assert "DEEPSEEK_V3" in [line.subject for line in report.routing]
    assert report.flashinfer != "" and str(report) == report.format()


@needs_flashinfer
def test_report_for_a_cpu_device_says_why():
    report = moe_ops.backends("cpu")
    assert report.device == "cpu (FlashInfer kernels need CUDA)"
    assert all(
        line.backend == "unavailable" and line.reason.startswith("needs a CUDA device, asked about cpu")
        for line in report.kernels
    )
    (deepseek,) = [line for line in report.routing if line.subject == "DEEPSEEK_V3"]
    assert deepseek.backend == "torch" and "needs a CUDA device" in deepseek.reason
    assert not fused_topk_support("cpu").ok and not trtllm_moe_support("cpu").ok
    line = routing_backend(1, "cpu")
    assert line.subject == "RENORMALIZE" and line.backend == "torch"
    assert line.reason == "PyTorch reference router (the Triton router needs a CUDA device, asked about cpu)"


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer is installed here")
def test_report_without_flashinfer_says_how_to_install():
    assert fused_topk_support().reason == _INSTALL_HINT


def test_routed_kernels_are_marked_as_not_writing_replay():
    lines = {line.subject: line for line in moe_ops.backends().kernels}
    assert "leaves routing_replay_out untouched" in lines["trtllm_bf16_routed_moe"].reason
    assert "leaves routing_replay_out untouched" not in lines["trtllm_bf16_moe"].reason


def test_cli_prints_the_report(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("moe-ops backends on ") and "trtllm_bf16_moe" in out and "DEEPSEEK_V3" in out


@pytest.mark.gpu
def test_report_on_the_gpu(cuda_device):
    cc = torch.cuda.get_device_capability(cuda_device)
    report = moe_ops.backends(cuda_device)
    lines = {line.subject: line for line in report.kernels}
    assert f"SM{cc[0]}{cc[1]}" in report.device
    if cc not in ((10, 0), (10, 3)):
        assert lines["trtllm_bf16_moe"].backend == "unavailable"
        assert lines["trtllm_bf16_moe"].reason == f"trtllm MoE: needs SM100/SM103, found SM{cc[0]}{cc[1]}"
    if cc >= (8, 9) and fused_topk_support(cuda_device).ok:
        assert lines["fused_topk_deepseek"].backend == "flashinfer"
        (deepseek,) = [line for line in report.routing if line.subject == "DEEPSEEK_V3"]
        # where FlashInfer runs, auto still routes with Triton: measured faster (docs/routing.md)
        assert deepseek.backend == "triton" and "measured faster" in deepseek.reason
    # fused_topk_deepseek has its own device list; every trtllm_*_moe kernel the trtllm-gen MoE one
    for name, line in lines.items():
        check = fused_topk_support if name == "fused_topk_deepseek" else trtllm_moe_support
        assert line.reason.startswith(check(cuda_device).reason), (name, line.reason)
    # auto is the Triton router on CUDA for every method (the reference only for rows over its tile)
    assert {line.backend for line in report.routing} == {"triton"}
