"""Device selection: what `SLUICE_DEVICE` asks for is checked at start-up, with a message naming what is missing."""

import sys

import pytest
import torch

from worker.engine import DeviceUnavailable, detect_device


def test_cpu_is_always_there():
    assert detect_device("cpu") == "cpu"


def test_cuda_asked_for_without_a_device_names_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailable, match=r"SLUICE_DEVICE=cuda.*install\.sh \.venv cuda.*nvidia-smi"):
        detect_device("cuda")


def test_npu_asked_for_without_torch_npu_names_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails as if it were not installed
    with pytest.raises(DeviceUnavailable, match=r"SLUICE_DEVICE=npu.*torch-npu is not installed.*CANN"):
        detect_device("npu")


def test_auto_falls_back_to_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert detect_device("auto") == "cpu"


def test_auto_picks_cuda_when_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert detect_device("auto") == "cuda"


async def test_the_worker_exits_1_with_the_reason_when_its_device_is_missing(monkeypatch):
    from tests.unit.harness import CATALOG, settings
    from worker import service

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    logged = []
    monkeypatch.setattr(service.log, "error", lambda event, **kw: logged.append((event, kw)))
    assert await service.run_worker(settings(device="cuda"), CATALOG) == 1
    assert logged and logged[0][0] == "device_unavailable" and "SLUICE_DEVICE=cuda" in logged[0][1]["error"]


def test_install_script_refuses_a_platform_without_a_build_in_one_line(tmp_path):
    import subprocess

    for extra, says in [("npu", "no NPU build to install"), ("tpu", "unknown extra 'tpu'")]:
        res = subprocess.run(["bash", "deploy/install.sh", str(tmp_path / "venv"), extra], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 2 and says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res
        assert not (tmp_path / "venv").exists()  # stopped before creating anything
