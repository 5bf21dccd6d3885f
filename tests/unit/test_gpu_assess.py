"""gpu: NVML readings (real pynvml constants, errors and field semantics) -> findings, on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from distdiag.errors import ConfigError
from distdiag.probes.base import ConsolidationView
from distdiag.probes.cluster.gpu import GpuConfig, GpuProbe, assess_device, read_device, throttle_names
from distdiag.report.model import RankInfo, exit_code_for

NOT_SUPPORTED = object()
"""A field this device does not support: the fake raises NVML_ERROR_NOT_SUPPORTED for it."""


class FakeNvml:
    """pynvml's API over a dict of device fields; a field set to NOT_SUPPORTED raises as NVML does."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported

    def __init__(self, **fields):
        self.f = {
            "name": b"NVIDIA H100 80GB HBM3", "uuid": "GPU-1111", "bus": "00000000:18:00.0",
            "driver": "550.54.15", "cuda": 12040, "ecc_mode": [1, 1],
            "ecc": {(1, 0): 0, (1, 1): 0, (0, 0): 3, (0, 1): 40},
            "retired_pending": pynvml.NVML_FEATURE_DISABLED, "remapped": (0, 0, 0, 0),
            "temp": 41, "slowdown": 87, "reasons": pynvml.nvmlClocksThrottleReasonGpuIdle,
            "power": 70_000, "limit": 700_000, "gen": 5, "gen_max": 5, "width": 16, "width_max": 16,
            "mem": SimpleNamespace(total=80 * 2**30, free=79 * 2**30, used=2**30),
            "persistence": pynvml.NVML_FEATURE_ENABLED, "mig": [0, 0],
        }
        self.f.update(fields)
        for name, value in vars(pynvml).items():
            if name.isupper() or name.startswith("nvmlClocks"):
                setattr(self, name, value)

    def _v(self, key):
        value = self.f[key]
        if value is NOT_SUPPORTED:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # pynvml turns this into NVMLError_NotSupported
        if isinstance(value, pynvml.NVMLError):
            raise value
        return value

    def nvmlDeviceGetName(self, h): return self._v("name")
    def nvmlDeviceGetUUID(self, h): return self._v("uuid")
    def nvmlDeviceGetPciInfo(self, h): return SimpleNamespace(busId=self._v("bus"))
    def nvmlSystemGetDriverVersion(self): return self._v("driver")
    def nvmlSystemGetCudaDriverVersion(self): return self._v("cuda")
    def nvmlDeviceGetEccMode(self, h): return self._v("ecc_mode")
    def nvmlDeviceGetTotalEccErrors(self, h, etype, counter):
        table = self._v("ecc")
        return table[(etype, counter)]
    def nvmlDeviceGetRetiredPagesPendingStatus(self, h): return self._v("retired_pending")
    def nvmlDeviceGetRemappedRows(self, h): return self._v("remapped")
    def nvmlDeviceGetTemperature(self, h, sensor): return self._v("temp")
    def nvmlDeviceGetTemperatureThreshold(self, h, kind): return self._v("slowdown")
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return self._v("reasons")
    def nvmlDeviceGetPowerUsage(self, h): return self._v("power")
    def nvmlDeviceGetEnforcedPowerLimit(self, h): return self._v("limit")
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h): return self._v("gen")
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): return self._v("gen_max")
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): return self._v("width")
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return self._v("width_max")
    def nvmlDeviceGetMemoryInfo(self, h): return self._v("mem")
    def nvmlDeviceGetPersistenceMode(self, h): return self._v("persistence")
    def nvmlDeviceGetMigMode(self, h): return self._v("mig")


def _assess(**fields):
    reading = read_device(FakeNvml(**fields), object())
    return reading, assess_device(reading, GpuConfig(), "host h1 cuda:0")


def _above_info(findings):
    return [f for f in findings if f["severity"] != "info"]


def test_healthy_h100_reads_every_field_and_finds_nothing():
    """A healthy idle GPU: all fields read, idle PCIe downshift would be info only, no finding above info."""
    reading, findings = _assess()
    assert reading["name"] == "NVIDIA H100 80GB HBM3" and reading["cuda_driver"] == "12.4"
    assert reading["ecc_corrected_aggregate"] == 40 and reading["remapped_rows"]["pending"] is False
    assert reading["unsupported"] == [] and reading["errors"] == {}
    assert _above_info(findings) == []


def test_not_supported_fields_are_none_and_never_a_finding():
    """A consumer GPU: no ECC, no remapping, no retirement, no threshold -> None, listed, no finding."""
    ns = NOT_SUPPORTED
    reading, findings = _assess(ecc_mode=ns, ecc=ns, retired_pending=ns, remapped=ns, slowdown=ns, mig=ns, persistence=ns)
    assert reading["ecc_uncorrected_volatile"] is None and reading["remapped_rows"] is None
    assert {"ecc_mode", "ecc_uncorrected_volatile", "remapped_rows", "retired_pages_pending", "mig_mode"} <= set(reading["unsupported"])
    assert reading["errors"] == {}
    assert _above_info(findings) == []


@pytest.mark.parametrize(
    "fields, severity, words, drain",
    [
        ({"ecc": {(1, 0): 2, (1, 1): 2, (0, 0): 0, (0, 1): 0}}, "error", "2 uncorrected ECC error(s) since the last driver load", True),
        ({"ecc": {(1, 0): 0, (1, 1): 5, (0, 0): 0, (0, 1): 0}}, "warning", "5 uncorrected ECC error(s) over the GPU's lifetime", False),
        ({"retired_pending": pynvml.NVML_FEATURE_ENABLED}, "error", "retired memory pages are pending", True),
        ({"remapped": (0, 1, 1, 0)}, "error", "row remapping is pending", True),
        ({"remapped": (0, 3, 0, 1)}, "error", "row remapping failed", True),
        ({"width": 8}, "error", "PCIe link degraded to x8 (max x16)", True),
        ({"gen": 3, "reasons": 0}, "warning", "gen 3 below its max gen 5 while not idle", False),
        ({"temp": 88}, "error", "temperature 88 C at or above its slowdown threshold 87 C", True),
        ({"temp": 86, "slowdown": NOT_SUPPORTED}, "warning", "temperature 86 C (threshold 85 C", False),
        ({"reasons": pynvml.nvmlClocksThrottleReasonHwSlowdown | pynvml.nvmlClocksThrottleReasonSwPowerCap}, "error", "clocks held down by hw_slowdown", True),
        ({"reasons": pynvml.nvmlClocksThrottleReasonSwThermalSlowdown}, "warning", "sw_thermal_slowdown", False),
        ({"mem": SimpleNamespace(total=80 * 2**30, free=40 * 2**30, used=40 * 2**30)}, "warning", "only 40.0 of 80.0 GiB free", False),
        ({"mig": [1, 1]}, "warning", "MIG mode is enabled", False),
        ({"temp": pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)}, "error", "NVML could not read temperature_c", True),
    ],
)
def test_each_bad_reading_gives_its_finding(fields, severity, words, drain):
    """One bad field at a time: the finding, its severity, and whether it drains the node."""
    _, findings = _assess(**fields)
    hits = [f for f in findings if words in f["issue"]]
    assert len(hits) == 1, [f["issue"] for f in findings]
    assert hits[0]["severity"] == severity and hits[0]["drain"] is drain
    assert hits[0]["issue"].startswith("host h1 cuda:0")


def test_idle_pcie_downshift_is_only_info():
    """Idle GPUs lower their link generation (ASPM): info, not a degraded link."""
    _, findings = _assess(gen=1)
    (f,) = [f for f in findings if "PCIe gen 1 of 5" in f["issue"]]
    assert f["severity"] == "info"
    assert throttle_names(0x41) == ["gpu_idle", "hw_thermal_slowdown"]


def _payload(rank, host, node, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", count=8, **fields):
    reading = read_device(FakeNvml(uuid=uuid, name=name.encode(), **fields), object())
    return {"host": host, "node": node, "local_rank": rank % 2, "status": "ok", "device": f"cuda:{rank % 2}",
            "gpu_count": count, "reading": reading}


def _view(n, opts):
    ranks = [RankInfo(r, f"h{r // 2}", r // 2, r % 2, f"cuda:{r % 2}", 10 + r) for r in range(n)]
    return ConsolidationView(world_size=n, ranks=ranks, options=opts)


def test_job_findings_shared_gpu_mixed_models_and_drain_exit_code():
    """Two ranks on one UUID, an A100 among H100s, an x8 link -> findings; the drain gives exit 4."""
    payloads = {
        0: _payload(0, "h0", 0, uuid="GPU-a"),
        1: _payload(1, "h0", 0, uuid="GPU-a"),
        2: _payload(2, "h1", 1, uuid="GPU-c", width=8),
        3: _payload(3, "h1", 1, uuid="GPU-d", name="NVIDIA A100-SXM4-80GB"),
    }
    result = GpuProbe().consolidate(payloads, _view(4, GpuConfig()))
    issues = {f.issue: f for f in result.findings}
    shared = next(f for i, f in issues.items() if "use the same GPU GPU-a" in i)
    assert shared.ranks == [0, 1] and "host h0" in shared.issue
    mixed = next(f for i, f in issues.items() if "mixed GPU models" in i)
    assert mixed.ranks == [3]
    link = next(f for i, f in issues.items() if "x8" in i)
    assert link.drain == {"host": "h1", "device": "00000000:18:00.0"} and link.ranks == [2]
    assert exit_code_for([result]) == 4


def test_required_gpu_missing_nvml_or_missing_gpus_fail_and_drain():
    """required: a node without NVML, and a node showing 7 of 8 GPUs, each fail with a drain of that host."""
    opts = GpuConfig(required=True, gpus_per_node=8)
    payloads = {
        0: {"host": "h0", "node": 0, "local_rank": 0, "status": "missing", "reason": "NVML did not load: NVML Shared Library Not Found"},
        1: {"host": "h0", "node": 0, "local_rank": 1, "status": "missing", "reason": "NVML did not load: NVML Shared Library Not Found"},
        2: _payload(2, "h1", 1, uuid="GPU-c", count=7),
        3: _payload(3, "h1", 1, uuid="GPU-d", count=7),
    }
    result = GpuProbe().consolidate(payloads, _view(4, opts))
    drains = {f.drain["host"]: f for f in result.findings if f.drain}
    assert "NVML did not load" in drains["h0"].issue and drains["h0"].ranks == [0, 1]
    assert "shows 7 GPU(s) through NVML, expected 8" in drains["h1"].issue
    assert result.status == "fail" and exit_code_for([result]) == 4


def test_config_is_validated_with_the_dotted_key():
    """Bad option values name probes.gpu.KEY and the value."""
    with pytest.raises(ConfigError, match=r"probes\.gpu\.gpus_per_node must be an integer in \[0, 1024\], got -1"):
        GpuConfig(gpus_per_node=-1)
    with pytest.raises(ConfigError, match=r"probes\.gpu\.required must be true or false"):
        GpuConfig(required="yes")
