"""What bench/gpu_check.py and bench/gpu_step.py compute and keep that a second on the CPU shows (their whole dry
run: tests/test_gpu_check.py): the MFU's peak for the card found, and the check's log written as each step runs."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import gpu_check  # noqa: E402
import gpu_step  # noqa: E402


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),  # SXM
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40", 181.05),  # 08e5dbc matched by a part: the L4's 121, the MFU 1.5x high
        ("NVIDIA L40S", 362.05),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA H100 80GB HBM3 (a name not listed)", None),
    ],
)
def test_the_mfu_peak_is_that_of_the_card_found(name, peak):
    assert gpu_step.peak_tflops(name) == peak


def test_every_card_of_the_table_gets_its_own_peak():
    for name, peak in gpu_step.PEAK_TFLOPS.items():
        assert gpu_step.peak_tflops(name) == peak, name


def test_a_steps_log_is_written_as_it_comes(tmp_path):
    """logs.txt holds what a step printed while it still runs (a step the device's timeout cuts leaves it), in this
    process and from a subprocess."""
    check = gpu_check.Check(str(tmp_path), str(tmp_path), dict(os.environ), "# header", budget_s=1e9)
    seen = []

    def step():
        print("first line of the step")
        seen.append((tmp_path / "logs.txt").read_text())
        return {}

    assert check.step("in-process", step)["ok"]
    assert "===== in-process\nfirst line of the step" in seen[0]
    cmd = [sys.executable, "-c", "import time; print('printed before the cut', flush=True); time.sleep(30)"]
    result = check.subprocess("cut", cmd, timeout=3)
    assert result["rc"] == "timeout" and not result["ok"]
    assert "printed before the cut" in (tmp_path / "logs.txt").read_text()
    check.log.close()
