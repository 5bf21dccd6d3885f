"""`gpu`: each rank's GPU as NVML sees it; findings that say which node and device to drain.

Reading (`read_device`) and deciding (`assess_device`, `assess_job`) are apart: the readings
are plain dicts with NVML's own units (degrees C, milliwatts, bytes, counts, bitmasks), a
field NVML reports as not supported on a device is None and listed in `unsupported`, and the
decisions are pure functions unit-tested on CPU against readings with those semantics.

Without NVML or a GPU the probe skips with the reason, unless the config marks it
`required`: then a node whose NVML fails to load, or that shows fewer than
`gpus_per_node` GPUs, fails the gate (and is marked for draining).
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from distdiag.errors import ConfigError
from distdiag.probes.base import ConsolidationView, Probe
from distdiag.report.model import Finding, ProbeResult

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

T = TypeVar("T")

__all__ = [
    "GpuConfig", "GpuProbe", "read_device", "assess_device", "assess_job", "memory_held_by_others", "THROTTLE_BITS",
    "OWN_OVERHEAD_BYTES",
]

THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
"""NVML's clocks-event (throttle) reason bits, nvmlClocksEventReason* in nvml.h."""
_HW_THROTTLE = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")


@dataclass
class GpuConfig:
    """Options of the gpu probe, the `[probes.gpu]` table."""

    required: bool = False
    """Fail (and drain the node) instead of skipping when NVML or the GPUs are missing."""
    gpus_per_node: int = 0
    """GPUs every node must show through NVML; 0: do not check the count."""
    max_temp_c: int = 85
    """Warn at this GPU temperature (degrees C) when NVML gives no slowdown threshold."""
    min_free_memory_fraction: float = 0.9
    """Warn when less than this fraction of a GPU's memory is free before the job starts."""
    max_corrected_ecc: int = 1000
    """Warn when volatile corrected ECC errors exceed this count."""

    def __post_init__(self) -> None:
        p = "probes.gpu"
        if not isinstance(self.required, bool):
            raise ConfigError(f"{p}.required must be true or false, got {self.required!r}")
        for key, top in (("gpus_per_node", 1024), ("max_temp_c", 200), ("max_corrected_ecc", 10**9)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                raise ConfigError(f"{p}.{key} must be an integer in [0, {top}], got {value!r}")
        f = self.min_free_memory_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1:
            raise ConfigError(f"{p}.min_free_memory_fraction must be within [0, 1], got {f!r}")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)



def _ecc_errors(nvml: ModuleType, handle: object, etype: int, counter: int) -> int:
    return int(nvml.nvmlDeviceGetTotalEccErrors(handle, etype, counter))


def _int_of(fn: Callable[[object], int], handle: object) -> int:
    return int(fn(handle))


def read_device(nvml: ModuleType, handle: object) -> dict[str, Any]:
    """Every field the probe uses, read through `nvml` (pynvml or a stand-in with its API)."""
    reading: dict[str, Any] = {"unsupported": [], "errors": {}}

    def get(name: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except nvml.NVMLError_NotSupported:
            reading["unsupported"].append(name)
        except nvml.NVMLError as exc:
            reading["errors"][name] = f"{type(exc).__name__}: {exc}"
        return None

    reading["name"] = get("name", lambda: _text(nvml.nvmlDeviceGetName(handle)))
    reading["uuid"] = get("uuid", lambda: _text(nvml.nvmlDeviceGetUUID(handle)))
    reading["pci_bus_id"] = get("pci_bus_id", lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId))
    reading["driver"] = get("driver", lambda: _text(nvml.nvmlSystemGetDriverVersion()))
    cuda = get("cuda_driver", nvml.nvmlSystemGetCudaDriverVersion)
    reading["cuda_driver"] = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
    ecc = get("ecc_mode", lambda: nvml.nvmlDeviceGetEccMode(handle))
    reading["ecc_enabled"] = bool(ecc[0]) if ecc is not None else None
    for kind, etype in (("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED), ("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)):
        for scope, counter in (("volatile", nvml.NVML_VOLATILE_ECC), ("aggregate", nvml.NVML_AGGREGATE_ECC)):
            key = f"ecc_{kind}_{scope}"
            reading[key] = get(key, functools.partial(_ecc_errors, nvml, handle, etype, counter))
    pending = get("retired_pages_pending", lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    reading["retired_pages_pending"] = None if pending is None else pending == nvml.NVML_FEATURE_ENABLED
    rows = get("remapped_rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    if rows is not None:
        corr, unc, is_pending, failed = rows
        reading["remapped_rows"] = {"corrected": int(corr), "uncorrected": int(unc), "pending": bool(is_pending), "failure": bool(failed)}
    else:
        reading["remapped_rows"] = None
    reading["temperature_c"] = get("temperature_c", lambda: int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)))
    reading["slowdown_temp_c"] = get(
        "slowdown_temp_c", lambda: int(nvml.nvmlDeviceGetTemperatureThreshold(handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
    )
    # nvmlDeviceGetCurrentClocksEventReasons is the newer name of the same bitmask.
    reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    reading["throttle_mask"] = get("throttle_reasons", lambda: int(reasons_fn(handle)))
    reading["power_mw"] = get("power_mw", lambda: int(nvml.nvmlDeviceGetPowerUsage(handle)))
    reading["power_limit_mw"] = get("power_limit_mw", lambda: int(nvml.nvmlDeviceGetEnforcedPowerLimit(handle)))
    for key, fn in (
        ("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
        ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
        ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
        ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
    ):
        reading[key] = get(key, functools.partial(_int_of, getattr(nvml, fn), handle))
    mem = get("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    reading["memory_total"] = int(mem.total) if mem is not None else None
    reading["memory_free"] = int(mem.free) if mem is not None else None
    running = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses", None)
    reading["processes"] = None if running is None else get("processes", lambda: _processes(running(handle)))
    persistence = get("persistence_mode", lambda: nvml.nvmlDeviceGetPersistenceMode(handle))
    reading["persistence_mode"] = None if persistence is None else persistence == nvml.NVML_FEATURE_ENABLED
    mig = get("mig_mode", lambda: nvml.nvmlDeviceGetMigMode(handle))
    reading["mig_mode"] = None if mig is None else {"current": bool(mig[0]), "pending": bool(mig[1])}
    return reading


def _processes(running: Any) -> list[dict[str, Any]]:
    """NVML's compute processes as {"pid", "used" (bytes, None where NVML cannot say)}."""
    return [{"pid": int(p.pid), "used": int(p.usedGpuMemory) if isinstance(p.usedGpuMemory, int) else None} for p in running]


def throttle_names(mask: int | None) -> list[str]:
    if not mask:
        return []
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]


def _f(severity: str, issue: str, evidence: str, fix: str, drain: bool = False) -> dict[str, Any]:
    return {"severity": severity, "issue": issue, "evidence": evidence, "fix": fix, "drain": drain}


def assess_device(r: dict[str, Any], opts: GpuConfig, where: str) -> list[dict[str, Any]]:
    """Findings about one GPU's reading. `where` names it ("host h GPU 3 (PCI 0000:...)")."""
    reasons = throttle_names(r.get("throttle_mask"))
    return (
        _read_errors(r, where)
        + _memory_errors(r, opts, where)
        + _temperature(r, opts, where)
        + _throttling(r, where, reasons)
        + _pcie_link(r, where, reasons)
        + _device_setup(r, opts, where)
    )


def _read_errors(r: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """NVML queries that failed on fields the device supports."""
    out = []
    for name, err in r["errors"].items():
        lost = "GpuIsLost" in err or "GPU_IS_LOST" in err
        out.append(_f("error", f"{where}: NVML could not read {name}: {err}",
                      "an NVML query failed on a field the device supports",
                      "run nvidia-smi -q on that host; a lost GPU needs a reset or a reboot", drain=lost))
    return out


def _memory_errors(r: dict[str, Any], opts: GpuConfig, where: str) -> list[dict[str, Any]]:
    """ECC counters, pending retired pages and row remapping."""
    out = []
    unc = r.get("ecc_uncorrected_volatile")
    if unc:
        out.append(_f("error", f"{where}: {unc} uncorrected ECC error(s) since the last driver load",
                      f"volatile uncorrected={unc}, aggregate uncorrected={r.get('ecc_uncorrected_aggregate')}",
                      "drain the node and reset the GPU; repeated errors mean a hardware replacement", drain=True))
    elif r.get("ecc_uncorrected_aggregate"):
        out.append(_f("warning", f"{where}: {r['ecc_uncorrected_aggregate']} uncorrected ECC error(s) over the GPU's lifetime",
                      "aggregate uncorrected ECC counter (none since the last driver load)",
                      "watch this GPU; if the count grows, replace it"))
    corr = r.get("ecc_corrected_volatile")
    if corr and corr > opts.max_corrected_ecc:
        out.append(_f("warning", f"{where}: {corr} corrected ECC errors since the last driver load (threshold {opts.max_corrected_ecc})",
                      "volatile corrected ECC counter", "many corrected errors often precede uncorrected ones: schedule a check"))
    if r.get("retired_pages_pending"):
        out.append(_f("error", f"{where}: retired memory pages are pending (take effect only after a GPU reset)",
                      "nvmlDeviceGetRetiredPagesPendingStatus = enabled", "drain the node and reset the GPU", drain=True))
    rows = r.get("remapped_rows")
    if rows and rows["failure"]:
        out.append(_f("error", f"{where}: row remapping failed ({rows['uncorrected']} rows remapped for uncorrected errors)",
                      f"remapped rows: {rows}", "drain the node; the GPU needs replacement", drain=True))
    elif rows and rows["pending"]:
        out.append(_f("error", f"{where}: a memory row remapping is pending (takes effect after a GPU reset)",
                      f"remapped rows: {rows}", "drain the node and reset the GPU", drain=True))
    return out


def _temperature(r: dict[str, Any], opts: GpuConfig, where: str) -> list[dict[str, Any]]:
    """Temperature against the slowdown threshold (or opts.max_temp_c when NVML gives none)."""
    temp, slow = r.get("temperature_c"), r.get("slowdown_temp_c")
    if temp is None:
        return []
    if slow is not None and temp >= slow:
        return [_f("error", f"{where}: temperature {temp} C at or above its slowdown threshold {slow} C",
                   f"temperature {temp} C, slowdown threshold {slow} C", "check the node's cooling and airflow", drain=True)]
    if slow is not None and temp >= slow - 5:
        return [_f("warning", f"{where}: temperature {temp} C within 5 C of its slowdown threshold {slow} C",
                   f"temperature {temp} C", "check the node's cooling")]
    if slow is None and temp >= opts.max_temp_c:
        return [_f("warning", f"{where}: temperature {temp} C (threshold {opts.max_temp_c} C; NVML gives no slowdown threshold)",
                   f"temperature {temp} C", "check the node's cooling")]
    return []


def _throttling(r: dict[str, Any], where: str, reasons: list[str]) -> list[dict[str, Any]]:
    """Clocks held down by hardware slowdown, or by the driver for temperature."""
    hw = [x for x in reasons if x in _HW_THROTTLE]
    if hw:
        return [_f("error", f"{where}: clocks held down by {', '.join(hw)}",
                   f"throttle reasons: {', '.join(reasons)}; power {_watts(r.get('power_mw'))} of {_watts(r.get('power_limit_mw'))}",
                   "hardware slowdown means power or thermal trouble on that board: drain and inspect", drain=True)]
    if "sw_thermal_slowdown" in reasons:
        return [_f("warning", f"{where}: clocks reduced by the driver for temperature (sw_thermal_slowdown)",
                   f"throttle reasons: {', '.join(reasons)}; temperature {r.get('temperature_c')} C", "check the node's cooling")]
    return []


def _pcie_link(r: dict[str, Any], where: str, reasons: list[str]) -> list[dict[str, Any]]:
    """A PCIe link narrower than its max, or at a lower generation while busy."""
    out = []
    width, width_max = r.get("pcie_width"), r.get("pcie_width_max")
    gen, gen_max = r.get("pcie_gen"), r.get("pcie_gen_max")
    if width is not None and width_max is not None and width < width_max:
        out.append(_f("error", f"{where}: PCIe link degraded to x{width} (max x{width_max})",
                      f"PCIe gen {gen} of {gen_max}, width x{width} of x{width_max}",
                      "reseat the GPU or riser; a narrow link starves host-device copies and GPUDirect", drain=True))
    if gen is not None and gen_max is not None and gen < gen_max:
        # Idle GPUs drop their link generation to save power (ASPM): only a busy one is degraded.
        if "gpu_idle" in reasons:
            out.append(_f("info", f"{where}: PCIe gen {gen} of {gen_max} while idle (normal power saving)",
                          f"throttle reasons: {', '.join(reasons)}", "none; recheck under load if transfers are slow"))
        else:
            out.append(_f("warning", f"{where}: PCIe link at gen {gen} below its max gen {gen_max} while not idle",
                          f"PCIe gen {gen} of {gen_max}, width x{width} of x{width_max}", "check BIOS PCIe settings and the riser"))
    return out


OWN_OVERHEAD_BYTES = 2 * 2**30
"""What this process may hold on its GPU beyond torch's reserved memory when NVML cannot tell
its share apart: its CUDA context (about 0.5 GiB) and NCCL's buffers (hundreds of MiB on a node
of 8 GPUs). An allowance, not yet measured here: the GPU check prints the readings."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def memory_held_by_others(total: int, free: int, processes: list[dict[str, Any]] | None,
                          own: dict[str, Any] | None) -> tuple[int, str]:
    """(bytes of this GPU that other processes hold, how that was known), from NVML's numbers.

    The gpu probe reads the GPU after NCCL's init and the probes before it: this process's own
    context, NCCL's buffers and torch's cache are in NVML's used memory. NVML's per-process
    usage (`processes`: pid and bytes each) excludes them exactly when this process's pid is
    among them (in a container NVML shows the host's pids, which are not ours); else this
    process's share is taken off as torch's reserved memory plus OWN_OVERHEAD_BYTES for its
    context (`own`: {"pid", "reserved", "cuda_context"}, None when not known).
    """
    used = max(0, total - free)
    pid = (own or {}).get("pid")
    if processes is not None and pid is not None and all(p.get("used") is not None for p in processes) \
            and any(p["pid"] == pid for p in processes):
        others = [p for p in processes if p["pid"] != pid]
        listed = ", ".join(f"pid {p['pid']} {_gib(p['used'])}" for p in others[:8]) or "none"
        return sum(p["used"] for p in others), f"NVML's per-process usage, this process (pid {pid}) left out: {listed}"
    if own is not None and own.get("reserved") is not None:
        mine = int(own["reserved"]) + (OWN_OVERHEAD_BYTES if own.get("cuda_context") else 0)
        return max(0, used - mine), (
            f"{_gib(used)} used, less this process's own: {_gib(int(own['reserved']))} reserved by torch"
            + (f" + {_gib(OWN_OVERHEAD_BYTES)} allowed for its CUDA context and NCCL" if own.get("cuda_context") else ""))
    return used, f"{_gib(used)} used (this process's own share not known)"


def _device_setup(r: dict[str, Any], opts: GpuConfig, where: str) -> list[dict[str, Any]]:
    """Memory other processes hold, MIG mode, and persistence mode."""
    out = []
    total, free = r.get("memory_total"), r.get("memory_free")
    if total and free is not None:
        others, how = memory_held_by_others(total, free, r.get("processes"), r.get("own"))
        left = total - others
        if left / total < opts.min_free_memory_fraction:
            out.append(_f("warning", f"{where}: only {left / 2**30:.1f} of {total / 2**30:.1f} GiB free for this job: "
                          f"other processes hold {_gib(others)}",
                          f"free {free} bytes of {total}; {how}",
                          "another process holds GPU memory: find it with nvidia-smi and end it"))
    mig = r.get("mig_mode")
    if mig and mig["current"]:
        out.append(_f("warning", f"{where}: MIG mode is enabled (the job sees a GPU slice)", f"MIG {mig}",
                      "disable MIG (nvidia-smi -mig 0) on training nodes unless slices are intended"))
    if mig and mig["pending"] != mig["current"]:
        out.append(_f("warning", f"{where}: a MIG mode change is pending a GPU reset", f"MIG {mig}", "reset the GPU"))
    if r.get("persistence_mode") is False:
        out.append(_f("info", f"{where}: persistence mode is off", "nvmlDeviceGetPersistenceMode = disabled",
                      "enable it (nvidia-smi -pm 1) so the driver stays loaded between jobs"))
    return out


def _watts(mw: int | None) -> str:
    return "n/a" if mw is None else f"{mw / 1000:.0f} W"


def assess_job(payloads: dict[int, dict[str, Any]], view: ConsolidationView, opts: GpuConfig) -> list[Finding]:
    """Findings across ranks: shared GPUs, mixed models, missing NVML or GPUs on a node."""
    out: list[Finding] = []
    by_uuid: dict[tuple[str, str], list[int]] = defaultdict(list)
    models: dict[str, list[int]] = defaultdict(list)
    nodes: dict[int, list[int]] = defaultdict(list)
    for rank, p in sorted(payloads.items()):
        nodes[p["node"]].append(rank)
        reading = p.get("reading")
        if reading and reading.get("uuid"):
            by_uuid[(p["host"], reading["uuid"])].append(rank)
        if reading and reading.get("name"):
            models[reading["name"]].append(rank)
    for (host, uuid), ranks in by_uuid.items():
        if len(ranks) > 1:
            out.append(Finding(
                severity="error",
                issue=f"ranks {', '.join(map(str, ranks))} on host {host} use the same GPU {uuid}",
                evidence=f"NVML UUID {uuid} read by each of those ranks",
                ranks=ranks,
                fix="bind each rank to its own GPU (torch.cuda.set_device(LOCAL_RANK)); check CUDA_VISIBLE_DEVICES per rank",
            ))
    if len(models) > 1:
        desc = "; ".join(f"{m} on ranks {','.join(map(str, rs))}" for m, rs in models.items())
        minority = sorted(r for rs in sorted(models.values(), key=len)[:-1] for r in rs)
        out.append(Finding(
            severity="warning",
            issue=f"mixed GPU models in one job: {desc}",
            evidence=desc, ranks=minority,
            fix="run on one GPU model: the job moves at the pace of the slowest one",
        ))
    for node, ranks in sorted(nodes.items()):
        first = payloads[ranks[0]]
        host = first["host"]
        missing = [r for r in ranks if payloads[r]["status"] != "ok"]
        if missing and opts.required:
            why = payloads[missing[0]]["reason"]
            out.append(Finding(
                severity="error",
                issue=f"node {node} (host {host}): required GPU check failed: {why}",
                evidence="; ".join(f"rank {r}: {payloads[r]['reason']}" for r in missing),
                ranks=missing,
                fix="check the NVIDIA driver on that host (nvidia-smi); drain it until it shows its GPUs",
                drain={"host": host, "device": None},
            ))
        counts = [c for r in ranks if (c := payloads[r].get("gpu_count")) is not None]
        count = max(counts) if counts else 0
        if opts.gpus_per_node and counts and count < opts.gpus_per_node:
            out.append(Finding(
                severity="error",
                issue=f"node {node} (host {host}) shows {count} GPU(s) through NVML, expected {opts.gpus_per_node}",
                evidence=f"nvmlDeviceGetCount per rank: {counts}",
                ranks=ranks,
                fix="a GPU fell off the bus or the driver lost it: drain the node and check nvidia-smi / dmesg (Xid errors)",
                drain={"host": host, "device": None},
            ))
    return out


def _device_handle(nvml: ModuleType, ctx: RankContext) -> tuple[object, str]:
    """The NVML handle of this rank's GPU (torch's device, by UUID; else LOCAL_RANK's)."""
    try:
        import torch

        if ctx.device.type == "cuda":
            uuid = str(torch.cuda.get_device_properties(ctx.device).uuid)
            uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
            return nvml.nvmlDeviceGetHandleByUUID(uuid), f"cuda:{ctx.device.index}"
    except (AttributeError, RuntimeError, nvml.NVMLError):
        pass
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        pick = visible[ctx.info.local_rank % len(visible)]
        if pick.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(pick)), f"GPU {pick}"
        return nvml.nvmlDeviceGetHandleByUUID(pick), pick
    index = ctx.info.local_rank % nvml.nvmlDeviceGetCount()
    return nvml.nvmlDeviceGetHandleByIndex(index), f"GPU {index}"


def _own_usage(ctx: RankContext) -> dict[str, Any]:
    """What this process holds on its GPU as torch knows it (for memory_held_by_others)."""
    own: dict[str, Any] = {"pid": os.getpid(), "reserved": 0, "cuda_context": False}
    try:
        import torch

        if torch.cuda.is_initialized():
            own["cuda_context"] = True
            own["reserved"] = int(torch.cuda.memory_reserved(ctx.device if ctx.device.type == "cuda" else None))
    except Exception:  # noqa: BLE001 - not known: the finding says so; local, strands no one
        own["reserved"] = None
    return own


def _nvml() -> tuple[ModuleType | None, str | None]:
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML did not load: {exc}"
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            pynvml.nvmlShutdown()
            return None, "NVML sees no GPU on this host"
    except pynvml.NVMLError as exc:
        pynvml.nvmlShutdown()
        return None, f"NVML cannot count GPUs: {exc}"
    return pynvml, None


class GpuProbe(Probe):
    name = "gpu"
    summary = "GPU health through NVML: ECC errors, pending retirements, throttling, degraded PCIe, shared or mixed GPUs, missing GPUs"
    Config = GpuConfig

    def skip_reason(self, ctx: RankContext) -> str | None:
        opts: GpuConfig = self.options(ctx)
        if opts.required:
            return None  # run, and report a missing NVML or GPU as a failure
        nvml, why = _nvml()
        if nvml is not None:
            nvml.nvmlShutdown()
        return why

    def run(self, ctx: RankContext) -> dict[str, Any]:
        info = ctx.info
        payload: dict[str, Any] = {"host": info.host, "node": info.node, "local_rank": info.local_rank}
        nvml, why = _nvml()
        if nvml is None:
            return {**payload, "status": "missing", "reason": why}
        try:
            payload["gpu_count"] = int(nvml.nvmlDeviceGetCount())
            handle, label = _device_handle(nvml, ctx)
            reading = read_device(nvml, handle)
            reading["own"] = _own_usage(ctx)
            payload.update(status="ok", device=label, reading=reading)
        except nvml.NVMLError as exc:
            payload.update(status="missing", reason=f"NVML could not open this rank's GPU: {exc}")
        finally:
            nvml.nvmlShutdown()
        return payload

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        opts: GpuConfig = self.options(view)
        findings: list[Finding] = []
        rows = []
        for rank, p in sorted(payloads.items()):
            reading = p.get("reading")
            if p["status"] != "ok" or not reading:
                continue
            where = f"host {p['host']} {p['device']} ({reading.get('name')}, PCI {reading.get('pci_bus_id')})"
            for item in assess_device(reading, opts, where):
                drain = item.pop("drain")
                findings.append(Finding(
                    **item, ranks=[rank],
                    drain={"host": p["host"], "device": reading.get("pci_bus_id") or p["device"]} if drain else None,
                ))
            rows.append({
                "rank": rank, "host": p["host"], "device": p["device"], "name": reading.get("name"),
                "uuid": reading.get("uuid"), "pci": reading.get("pci_bus_id"), "driver": reading.get("driver"),
                "temp_c": reading.get("temperature_c"), "power_w": _watts(reading.get("power_mw")),
                "pcie": f"gen{reading.get('pcie_gen')}/{reading.get('pcie_gen_max')} x{reading.get('pcie_width')}/{reading.get('pcie_width_max')}",
                "throttle": ",".join(throttle_names(reading.get("throttle_mask"))) or "-",
                "unsupported": ",".join(reading["unsupported"]) or "-",
            })
        findings += assess_job(payloads, view, opts)
        missing = {r: p["reason"] for r, p in payloads.items() if p["status"] != "ok"}
        if missing and not opts.required and len(missing) < len(payloads):
            findings.append(Finding(
                severity="info", issue=f"no GPU reading on ranks {', '.join(map(str, sorted(missing)))}",
                evidence="; ".join(sorted(set(missing.values()))), ranks=sorted(missing),
            ))
        details = {"table:gpus": rows, "readings": {str(r): p.get("reading") for r, p in sorted(payloads.items())}}
        return ProbeResult.from_findings(self.name, findings, metrics={"gpus_read": len(rows)}, details=details)
