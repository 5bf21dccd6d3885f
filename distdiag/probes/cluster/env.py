"""`env`: what each rank runs on, and what differs between ranks that must not."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil
import torch

from distdiag.probes.base import ConsolidationView, Probe
from distdiag.report.model import Finding, ProbeResult

if TYPE_CHECKING:
    from distdiag.runtime.context import RankContext

__all__ = ["EnvProbe", "EnvConfig"]

_ENV_PREFIXES = ("MASTER_", "NCCL_", "TORCH_", "GLOO_", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
# Set per rank or per node by the launcher on purpose: never a mismatch.
_PER_RANK_VARS = {"CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"}
_VERSION_KEYS = ("python", "torch", "cuda", "nccl", "driver")


@dataclass
class EnvConfig:
    """Options of the env probe, the `[probes.env]` table."""

    clock_skew_warn_s: float = 1.0
    """Warn when host clocks differ by more than this many seconds."""
    shm_min_mib: int = 512
    """Warn when /dev/shm is smaller than this (NCCL and DataLoader workers use it)."""

    def __post_init__(self) -> None:
        from distdiag.errors import ConfigError

        if not self.clock_skew_warn_s > 0:
            raise ConfigError(f"probes.env.clock_skew_warn_s must be > 0, got {self.clock_skew_warn_s}")
        if not isinstance(self.shm_min_mib, int) or self.shm_min_mib < 0:
            raise ConfigError(f"probes.env.shm_min_mib must be an integer >= 0, got {self.shm_min_mib!r}")


def _cuda_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"cuda": torch.version.cuda, "nccl": None, "driver": None}
    if torch.cuda.is_available():
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a version is informative only; strands no one: local, before any collective
            out["nccl"] = None
        try:
            import pynvml

            pynvml.nvmlInit()
            out["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - no NVML: say nothing of the driver; strands no one: local lookup
            out["driver"] = None
    return out


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _shm() -> dict[str, int] | None:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return None
    return {"total": usage.total, "free": usage.free}


class EnvProbe(Probe):
    name = "env"
    summary = "version mismatches between ranks, two ranks on one GPU, CPU oversubscription, tiny /dev/shm, clock skew"
    Config = EnvConfig

    def run(self, ctx: RankContext) -> dict[str, Any]:
        info = ctx.info
        mem = psutil.virtual_memory()
        payload: dict[str, Any] = {
            "host": info.host,
            "pid": info.pid,
            "local_rank": info.local_rank,
            "local_world_size": info.local_world_size,
            "node": info.node,
            "device": str(ctx.device),
            "device_uuid": _device_uuid(ctx.device),
            "python": platform.python_version(),
            "torch": torch.__version__,
            **_cuda_versions(),
            "platform": platform.platform(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)},
            "cores": _usable_cores(),
            "cores_logical": psutil.cpu_count(logical=True),
            "threads": torch.get_num_threads(),
            "mem_total": mem.total,
            "mem_available": mem.available,
            "shm": _shm(),
            "executable": sys.executable,
        }
        # Every rank reads its clock right after leaving the same barrier: the spread between
        # hosts is their clock skew plus the barrier's exit jitter (milliseconds).
        ctx.comm.barrier()
        payload["clock"] = time.time()
        return payload

    def consolidate(self, payloads: dict[int, dict[str, Any]], view: ConsolidationView) -> ProbeResult:
        opts: EnvConfig = self.options(view)
        findings: list[Finding] = []
        findings += _version_mismatches(payloads)
        findings += _device_collisions(payloads)
        findings += _oversubscription(payloads)
        findings += _shm_findings(payloads, opts)
        skew, skew_finding = _clock_skew(payloads, opts)
        findings += skew_finding
        findings += _env_mismatches(payloads)
        rows = [
            {
                "rank": r,
                "host": p["host"],
                "local": p["local_rank"],
                "device": p["device"],
                "pid": p["pid"],
                "threads": p["threads"],
                "torch": p["torch"],
            }
            for r, p in sorted(payloads.items())
        ]
        metrics = {"clock_skew_s": skew, "hosts": len({p["host"] for p in payloads.values()})}
        details = {"ranks": rows, "versions": {k: _by_value(payloads, k) for k in _VERSION_KEYS}}
        return ProbeResult.from_findings(self.name, findings, metrics=metrics, details=details)


def _by_value(payloads: dict[int, dict[str, Any]], key: str) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for rank, p in sorted(payloads.items()):
        groups[str(p.get(key))].append(rank)
    return dict(groups)


def _odd_ranks(groups: dict[str, list[int]]) -> list[int]:
    """The odd ones out: every rank not in the largest group of equal values."""
    majority = max(groups.values(), key=len)
    return sorted(r for ranks in groups.values() if ranks is not majority for r in ranks)


def _describe_groups(groups: dict[str, list[int]]) -> str:
    from distdiag.report.render import format_ranks

    return "; ".join(f"{value} on {format_ranks(ranks)}" for value, ranks in groups.items())


def _version_mismatches(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    out = []
    for key in _VERSION_KEYS:
        groups = _by_value(payloads, key)
        if len(groups) > 1:
            odd = _odd_ranks(groups)
            out.append(
                Finding(
                    severity="error",
                    issue=f"{key} version differs between ranks: {_describe_groups(groups)}",
                    evidence=f"{key} per rank: {_describe_groups(groups)}",
                    ranks=odd,
                    fix=f"install the same {key} version on every node (one container image for the job)",
                )
            )
    return out


def _device_uuid(device: torch.device) -> str | None:
    """The GPU's UUID as CUDA reports it (the same GPU has the same UUID in every process,
    whatever CUDA_VISIBLE_DEVICES renumbers); None off CUDA or where torch does not say."""
    if device.type != "cuda":
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # noqa: BLE001 - an older torch without the field: keyed by index instead; local, strands no one
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def physical_device(device: str, visible: str | None) -> str:
    """The GPU a process's `cuda:N` is on this host: entry N of its CUDA_VISIBLE_DEVICES (an index
    or a UUID), or N itself when the variable is unset. With per-rank CUDA_VISIBLE_DEVICES (Slurm's
    --gpus-per-task=1 or --gpu-bind, one GPU per rank) every rank's `cuda:0` is another GPU."""
    index = int(device.split(":", 1)[1]) if ":" in device and device.split(":", 1)[1].isdigit() else 0
    if visible is None:
        return f"GPU {index}"
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        return f"GPU {index} (beyond CUDA_VISIBLE_DEVICES={visible!r})"
    pick = entries[index]
    return f"GPU {int(pick)}" if pick.isdigit() else pick


def device_key(payload: dict[str, Any]) -> tuple[str, str] | None:
    """(host, the physical GPU) a rank computes on, or None off CUDA: the UUID where torch gave
    one (as the gpu probe keys by NVML's), else the CUDA_VISIBLE_DEVICES-resolved index."""
    device = str(payload.get("device", ""))
    if not device.startswith("cuda"):
        return None
    uuid = payload.get("device_uuid")
    if uuid:
        return payload["host"], str(uuid)
    return payload["host"], physical_device(device, (payload.get("env") or {}).get("CUDA_VISIBLE_DEVICES"))


def _device_collisions(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    seen: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, p in sorted(payloads.items()):
        key = device_key(p)
        if key is not None:
            seen[key].append(rank)

    def visible(r: int) -> str:
        value = (payloads[r].get("env") or {}).get("CUDA_VISIBLE_DEVICES")
        return "<unset>" if value is None else repr(value)

    def what(gpu: str, ranks: list[int]) -> str:
        devices = {payloads[r]["device"] for r in ranks}
        plain = len(devices) == 1 and all(visible(r) == "<unset>" and not payloads[r].get("device_uuid") for r in ranks)
        return f"device {devices.pop()}" if plain else f"GPU ({gpu})"

    return [
        Finding(
            severity="error",
            issue=f"ranks {', '.join(map(str, ranks))} on host {host} are bound to the same {what(gpu, ranks)}",
            evidence=(f"LOCAL_RANK per rank: {', '.join(str(payloads[r]['local_rank']) for r in ranks)}; "
                      f"device per rank: {', '.join(payloads[r]['device'] for r in ranks)}; "
                      f"CUDA_VISIBLE_DEVICES per rank: {', '.join(visible(r) for r in ranks)}"),
            ranks=ranks,
            fix="bind each rank to its LOCAL_RANK's GPU (torch.cuda.set_device(local_rank)); check CUDA_VISIBLE_DEVICES",
        )
        for (host, gpu), ranks in seen.items()
        if len(ranks) > 1
    ]


def _oversubscription(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    out = []
    hosts: dict[str, list[int]] = defaultdict(list)
    for rank, p in payloads.items():
        hosts[p["host"]].append(rank)
    for host, ranks in sorted(hosts.items()):
        ranks.sort()
        cores = min(payloads[r]["cores"] for r in ranks)
        threads = max(payloads[r]["threads"] for r in ranks)
        local = len(ranks)
        if threads > 1 and threads * local > cores:
            out.append(
                Finding(
                    severity="warning",
                    issue=(
                        f"host {host}: {local} ranks x {threads} intra-op threads = "
                        f"{threads * local} threads on {cores} usable cores (CPU oversubscription)"
                    ),
                    evidence=f"torch.get_num_threads()={threads}, usable cores={cores}, ranks on host={local}",
                    ranks=ranks,
                    fix=f"set OMP_NUM_THREADS={max(1, cores // local)} (cores / ranks per host) for each rank",
                )
            )
        elif local > cores:
            out.append(
                Finding(
                    severity="info",
                    issue=f"host {host}: {local} ranks share {cores} usable cores (more ranks than cores)",
                    evidence=f"intra-op threads per rank: {threads}",
                    ranks=ranks,
                    fix="expected on a small test box; on a real node run one rank per GPU",
                )
            )
    return out


def _shm_findings(payloads: dict[int, dict[str, Any]], opts: EnvConfig) -> list[Finding]:
    out = []
    hosts: dict[str, list[int]] = defaultdict(list)
    for rank, p in payloads.items():
        hosts[p["host"]].append(rank)
    for host, ranks in sorted(hosts.items()):
        shm = payloads[min(ranks)].get("shm")
        if shm is None:
            continue
        mib = shm["total"] / 2**20
        if mib < opts.shm_min_mib:
            out.append(
                Finding(
                    severity="warning",
                    issue=f"host {host}: /dev/shm is {mib:.0f} MiB, below {opts.shm_min_mib} MiB",
                    evidence=f"/dev/shm total {shm['total']} bytes, free {shm['free']} bytes",
                    ranks=sorted(ranks),
                    fix="give the container more shared memory (docker --shm-size=8g, or a Memory emptyDir on /dev/shm in Kubernetes)",
                )
            )
    return out


def _clock_skew(payloads: dict[int, dict[str, Any]], opts: EnvConfig) -> tuple[float, list[Finding]]:
    by_host: dict[str, list[float]] = defaultdict(list)
    for p in payloads.values():
        by_host[p["host"]].append(p["clock"])
    medians = {h: sorted(v)[len(v) // 2] for h, v in by_host.items()}
    if len(medians) < 2:
        return 0.0, []
    reference = sorted(medians.values())[len(medians) // 2]
    skew = max(medians.values()) - min(medians.values())
    odd = {h: t - reference for h, t in medians.items() if abs(t - reference) > opts.clock_skew_warn_s}
    if skew <= opts.clock_skew_warn_s:
        return round(skew, 6), []
    ranks = sorted(r for r, p in payloads.items() if p["host"] in odd)
    return round(skew, 6), [
        Finding(
            severity="warning",
            issue=f"host clocks differ by {skew:.2f} s (threshold {opts.clock_skew_warn_s} s)",
            evidence="offset from the median host: " + ", ".join(f"{h} {d:+.2f} s" for h, d in sorted(odd.items())),
            ranks=ranks,
            fix="run NTP/chrony on every node; skewed clocks make logs and timeouts hard to correlate",
            confidence=0.8,
        )
    ]


def _env_mismatches(payloads: dict[int, dict[str, Any]]) -> list[Finding]:
    names = set()
    for p in payloads.values():
        names.update(p["env"])
    out = []
    for name in sorted(names - _PER_RANK_VARS):
        groups: dict[str, list[int]] = defaultdict(list)
        for rank, p in sorted(payloads.items()):
            groups[p["env"].get(name, "<unset>")].append(rank)
        if len(groups) > 1:
            odd = _odd_ranks(groups)
            out.append(
                Finding(
                    severity="warning",
                    issue=f"environment variable {name} differs between ranks",
                    evidence=_describe_groups(dict(groups)),
                    ranks=odd,
                    fix=f"set {name} the same way on every node (launcher or job script)",
                    confidence=0.7,
                )
            )
    return out
