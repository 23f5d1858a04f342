"""moe_ops.backends(): the report, the CLI subcommand; ``import moe_ops`` does not import flashinfer."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import moe_ops
from moe_ops.cli import main
from moe_ops.flashinfer import SPECS
from moe_ops.flashinfer.backends import fused_topk_support, trtllm_moe_support
from moe_ops.router.policy import routing_backend

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(
    not HAS_FLASHINFER, reason="flashinfer-python is not installed (moe-ops[flashinfer])"
)


def test_import_moe_ops_does_not_import_flashinfer():
    code = "import sys, moe_ops, moe_ops.flashinfer; sys.exit('flashinfer' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"import moe_ops imported flashinfer: {result.stderr}"


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
    assert line.backend == "torch" and "DEEPSEEK_V3 only" in line.reason


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer is installed here")
def test_report_without_flashinfer_says_how_to_install():
    assert fused_topk_support().reason == "flashinfer not installed (pip install 'moe-ops[flashinfer]')"


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
        # where FlashInfer runs, auto still routes with Triton: measured faster (PREFER_FLASHINFER_ROUTING)
        assert deepseek.backend == "triton" and "measured faster" in deepseek.reason
