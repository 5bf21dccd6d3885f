"""What torch itself records of the collectives each process group issued: the flight recorder.

For every process group, torch keeps the sequence numbers of the last collective enqueued,
started and completed (`pg_status` in a recorder dump), whoever issued it: our probes, DDP's
reducer inside `backward()`, FSDP, a compiled graph, NCCL kernels queued long before a rank
blocks in `.item()`. It also keeps an entry per collective (op, sizes, dtypes,
`collective_seq_id`, state, `time_created_ns`). A rank is *inside collective #N on group G*
when it enqueued #N and has not completed it; a rank whose count on G is lower *never
entered* #N. Python wrappers see none of the collectives torch issues from C++; these
numbers see all of them.

`EngineReader` reads this live, for the watchdog thread and the check's tracker: about
0.1 ms per look, on their thread, never on the training thread. `positions_from_dump` reads
one rank's dump file alone (distdiag/hang/dumpgroups.py reads dumps of every version). What differs by version or backend degrades with a
stated reason, never an exception:

- torch without a JSON dump function (or a backend without a recorder): `unavailable`;
- the recorder turned off (`TORCH_FR_BUFFER_SIZE=0`, or a torch whose default is 0): `off`;
- `last_started_collective` is -1 on gloo, and on NCCL unless start events are recorded
  (`TORCH_NCCL_ENABLE_TIMING=1`): "started" is then unknown, and a stall inside the network
  cannot be told from a rank whose GPU never started the collective;
- on gloo (torch 2.13) numbers come as strings, entries stay `scheduled`, `pg_config`
  carries no membership: group labels come from this process's own groups instead.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import ModuleType
from typing import Any

from distdiag.hang.frontcore import Pos, open_seq
from distdiag.hang.groupid import GroupId, parse_label, shown_desc

__all__ = [
    "EngineReader",
    "FR_BUFFER_ENV",
    "NCCL_TIMING_ENV",
    "enable_recorder",
    "recorder_enabled",
    "positions_from_dump",
    "compact_entry",
    "op_name",
    "pending_groups",
    "group_label",
    "groups_made",
    "entry_site",
    "dtype_name",
    "SYMBOLIZER",
    "load_symbolizer",
    "loaded",
    "bind_reader_thread",
]

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
_LEGACY_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
"""NCCL records a collective's start (and so `last_started_collective`) only with start events."""

_DUMPERS = (("fr", "_dump_fr_trace_json"), ("nccl", "_dump_nccl_trace_json"))
"""torch's JSON dump functions: the CPU recorder (gloo, torch >= 2.7) and NCCL's (CUDA builds)."""
_STACK_DUMPERS = (("fr", "_dump_fr_trace"), ("nccl", "_dump_nccl_trace"))
"""The pickle forms: only they carry each entry's Python `frames` (the JSON form has no stacks)."""
SYMBOLIZER = "torch._inductor.codecache"
"""The module torch's stack symbolizer reaches for (`torch._inductor.codecache.PyCodeCache`, to
map compiled code's frames) the first time a pickle dump with stacks is made: about 850 modules
(inductor, dynamo, sympy), 0.9 s of CPU. Made from one of our threads while the training thread
imports dynamo or inductor itself (parallelize_module, fully_shard, torch.compile), the two
imports interleave and the user's thread gets a partially initialised module
("cannot import name 'IndentedBuffer' from partially initialized module 'torch._inductor.utils'").
So stacks are read only once it is fully imported: by `load_symbolizer` on the training thread
before the watchdog's threads start, or by the job itself."""
_NOT_SITES = ("/torch/", "/distdiag/watchdog/", "/distdiag/watch.py", "/runpy.py", "/threading.py",
              "/typing_extensions.py", "/warnings.py", "/contextlib.py", "/functools.py")
"""Frames that are not the job's call site: torch's own (all_reduce, c10d_logger.wrapper, DDP,
autograd), distdiag's runner and Python's (the deprecation wrapper torch puts around
all_gather_into_tensor's old names lives in typing_extensions, or warnings on Python 3.13)."""


def recorder_enabled() -> bool:
    """False only when the user turned the recorder off by environment (0 entries)."""
    raw = os.environ.get(FR_BUFFER_ENV) or os.environ.get(_LEGACY_BUFFER_ENV)
    if raw is None:
        return True  # torch's own default decides (2000 entries on 2.13; 0 on some older ones)
    try:
        return int(raw) > 0
    except ValueError:
        return False


def enable_recorder(entries: int, *, timing: bool = False) -> str | None:
    """Turn the recorder on for process groups created from now on; a warning or None.

    The buffer size is read when a process group is created, so this must run before
    `init_process_group`. A value the user set is kept (with a note when it differs).
    `timing` (asked for: `--nccl-timing`) also records NCCL's start events, unless the user set
    them: a collective that started everywhere but never completed then tells a fabric stall
    apart from a rank whose GPU never started it. It costs a start and a timing end event per
    NCCL collective (cost not measured on a GPU yet), so it is off unless asked, and never with
    the recorder off (`entries` <= 0): without entries there is nothing to read it from.
    """
    if entries <= 0:
        return None
    if timing:
        os.environ.setdefault(NCCL_TIMING_ENV, "1")
    current = os.environ.get(FR_BUFFER_ENV) or os.environ.get(_LEGACY_BUFFER_ENV)
    if current:
        return None if current == str(entries) else f"keeping the user's {FR_BUFFER_ENV}={current} (not {entries})"
    os.environ[FR_BUFFER_ENV] = str(entries)
    return None


_THREAD = threading.local()


def bind_reader_thread() -> None:
    """Give the thread that reads the recorder the rank's CUDA device, as torch's own watchdog
    thread does, before a read that may query CUDA events (an entry's state).

    A thread starts on device 0: its first CUDA call would make a context on GPU 0, from every
    rank of the node. Only once CUDA is initialised (this never initialises it), never on the
    main thread (the training thread's device is the job's own), once per thread. The device is
    the default process group's (`device_id` at init), else LOCAL_RANK's where that many GPUs are
    visible (one visible GPU: that one). What it cannot set is the thread's CUDA-graph capture
    mode (torch's watchdog uses the thread-local mode; no Python API does), docs/watchdog.md.
    """
    if getattr(_THREAD, "bound", False) or threading.current_thread() is threading.main_thread():
        return
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return
        index = _rank_gpu(torch)
        if index is not None:
            torch.cuda.set_device(index)
        _THREAD.bound = True
    except Exception:  # noqa: BLE001 - reads still work, on the thread's default device
        _THREAD.bound = True


def _rank_gpu(torch: Any) -> int | None:
    try:
        from torch.distributed import distributed_c10d as c10d

        bound = getattr(c10d._get_default_group(), "bound_device_id", None)
        if bound is not None and bound.type == "cuda" and bound.index is not None:
            return int(bound.index)
    except Exception:  # noqa: BLE001 - no default group, or a torch without the field
        pass
    count = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if count == 1:
        return 0
    return local if 0 <= local < count else None


def op_name(profiling_name: Any) -> str:
    """'gloo:all_reduce' -> 'all_reduce' (the backend is said elsewhere)."""
    return str(profiling_name or "?").split(":", 1)[-1]


def job_frame(filename: str) -> bool:
    """A frame of the job's own code (or a library it calls), not torch's or distdiag's runner:
    a call site is the innermost such frame, for the recorder's entries and a dead rank's stack alike."""
    return bool(filename) and not any(part in filename for part in _NOT_SITES)


def entry_site(frames: Any) -> str | None:
    """The job's line that issued a recorded collective: its innermost frame outside torch and
    distdiag's runner, as 'file:line in function' (the wrappers' format); None if none is."""
    if not isinstance(frames, list | tuple):
        return None
    for f in frames:  # innermost first: all_reduce, c10d_logger.wrapper, then the caller
        if not isinstance(f, dict):
            continue
        name = str(f.get("filename") or "")
        if job_frame(name):
            return f"{name}:{f.get('line', '?')} in {f.get('name', '?')}"
    return None


def _int(value: Any, default: int = -1) -> int:
    """The recorder's numbers are ints in the documented format and strings on torch 2.13."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _pg_name(entry: dict[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, list | tuple) and pg:
        return str(pg[0])
    return str(entry.get("pg_id", "?"))


def compact_entry(entry: dict[str, Any], label: str | None = None) -> dict[str, Any]:
    """One recorder entry as snapshots and reports carry it; without `label`, its group goes by
    torch's name ('group 5': the members are not known here)."""
    sizes = entry.get("input_sizes")
    dtypes = entry.get("input_dtypes")
    profiling = str(entry.get("profiling_name") or "?")
    return {
        "pg": _pg_name(entry),
        "pg_id": str(entry.get("pg_id", "")),
        "group": label or GroupId(name=_pg_name(entry)).label,
        "seq": _int(entry.get("collective_seq_id"), 0),
        "op": op_name(entry.get("profiling_name")),
        "backend": profiling.split(":", 1)[0] if ":" in profiling else "?",
        "sizes": sizes if isinstance(sizes, list) else None,
        "dtypes": dtypes if isinstance(dtypes, list) else None,
        "state": entry.get("state"),
        "p2p": bool(entry.get("is_p2p")),
        "created_ns": _int(entry.get("time_created_ns"), 0),
    }


def _shape_of(c: dict[str, Any]) -> list[int] | None:
    sizes = c.get("sizes")
    if isinstance(sizes, list) and sizes and isinstance(sizes[0], list):
        return [_int(s, 0) for s in sizes[0]]
    return None


_SCALAR_TYPES = {
    "float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16", "int": "int32",
    "long": "int64", "short": "int16", "char": "int8", "byte": "uint8", "bool": "bool",
    "complexfloat": "complex64", "complexdouble": "complex128",
}
"""The recorder names dtypes by c10's ScalarType (Float, Long); torch.float32 is what users
read and what the wrappers record, so reports read the same with or without them."""


def dtype_name(raw: Any) -> str:
    """'Float' -> 'float32' (unknown names pass through, lower-cased)."""
    name = str(raw).lower()
    return _SCALAR_TYPES.get(name, name)


def _dtype_of(c: dict[str, Any]) -> str:
    dtypes = c.get("dtypes")
    if isinstance(dtypes, list) and dtypes:
        return dtype_name(dtypes[0])
    return "?"


def _group_entry(name: str, label: str, status: dict[str, Any], backend: str) -> dict[str, Any]:
    enq = _int(status.get("last_enqueued_collective"))
    started = _int(status.get("last_started_collective"))
    done = _int(status.get("last_completed_collective"))
    return {
        "pg": name,
        "group": label,
        "backend": backend,
        "enqueued": enq,
        "started": started if started >= 0 else None,
        "completed": done,
        "pending": None,
    }


def _inside_seq(group: dict[str, Any], open_seqs: dict[tuple[str, str], list[int]]) -> int:
    """The collective the rank is inside on the group. On NCCL its oldest open one (the first
    past its completions that the recorder still holds open, hang/frontcore.py's rule, as for
    dumps): the ones enqueued after it are queued behind it on the GPU, while the training
    thread waits elsewhere (at a later synchronisation). On gloo, where the caller waits inside
    the one it called, the last enqueued."""
    if group["backend"] != "nccl":
        return int(group["enqueued"])
    first = open_seq(Pos(group["enqueued"], group["completed"]))
    seqs = [s for s in open_seqs.get((group["backend"], group["pg"]), ()) if first is not None and first <= s <= group["enqueued"]]
    return min(seqs, default=int(group["enqueued"]))


def _attach_pending(group: dict[str, Any], entry: dict[str, Any] | None, now_ns: int, first_seen: float | None,
                    seq: int | None = None) -> None:
    """Mark the group as inside collective `seq` (its last enqueued by default), with what the
    entry says of it."""
    seq = group["enqueued"] if seq is None else seq
    pending: dict[str, Any] = {"seq": seq, "op": "?", "shape": None, "dtype": "?", "for_s": None, "state": None}
    if entry is not None:
        pending.update(op=entry["op"], shape=_shape_of(entry), dtype=_dtype_of(entry), state=entry.get("state"))
        if entry.get("call_site"):
            pending["call_site"] = entry["call_site"]
        if entry.get("created_ns"):
            pending["for_s"] = round(max(0.0, (now_ns - entry["created_ns"]) / 1e9), 3)
    if pending["for_s"] is None and first_seen is not None:
        pending["for_s"] = round(time.monotonic() - first_seen, 3)
    group["pending"] = pending


def pending_groups(engine: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The groups of one rank's engine view that are inside a collective, oldest first."""
    if not engine or engine.get("state") != "ok":
        return []
    out = [g for g in engine.get("groups", []) if g.get("pending")]
    return sorted(out, key=lambda g: -(g["pending"].get("for_s") or 0.0))


class EngineReader:
    """Live reads of this process's flight recorder, with labels for its own groups.

    One per thread that reads (the reads take torch's recorder lock for a moment; the
    bookkeeping here is not shared between threads).
    """

    def __init__(self, dumpers: list[tuple[str, Any]] | None = None, stack_dumpers: list[tuple[str, Any]] | None = None) -> None:
        """`dumpers`: (tag, fn(include_collectives, only_active) -> JSON) to read instead of
        torch's own (tests feed dumps of other versions and backends through it);
        `stack_dumpers`: (tag, fn() -> pickle bytes with frames), the call sites' source."""
        self._fns: list[tuple[str, Any]] = []
        self._stack_fns: list[tuple[str, Any]] = []
        self._stack_fns_are_torch = False
        """torch's own stack dumps (not fed by a test): they import SYMBOLIZER when first called."""
        self._warmed: Any = None
        self.sites_state = "cold"
        """cold | warming | ready | failed: the pickle dump's first call symbolizes the recorded
        stacks (about 1.4 s of CPU, seconds of wall time on a busy host, once per process;
        later calls take milliseconds), so it is made once on a thread of its own, and a
        snapshot reads call sites only once that is done."""
        self.reason = ""
        version = "?"
        try:
            import torch

            version = torch.__version__
            given = dumpers is not None
            if dumpers is None:
                c10d = torch._C._distributed_c10d
                dumpers = [(tag, getattr(c10d, name)) for tag, name in _DUMPERS if hasattr(c10d, name)]
            self._fns = list(dumpers)
            if stack_dumpers is None and given:  # fed dumps: no stacks unless fed those too
                stack_dumpers = []
            if stack_dumpers is None:
                c10d = torch._C._distributed_c10d
                stack_dumpers = [(tag, getattr(c10d, name)) for tag, name in _STACK_DUMPERS if hasattr(c10d, name)]
            self._stack_fns = list(stack_dumpers)
            self._stack_fns_are_torch = not given and bool(self._stack_fns)
        except Exception as exc:  # noqa: BLE001 - no torch.distributed at all
            self.reason = f"torch.distributed is not available ({type(exc).__name__})"
        if not self._fns and not self.reason:
            self.reason = (
                f"torch {version} has no JSON flight-recorder dump (_dump_fr_trace_json needs torch >= 2.7 for gloo; "
                "NCCL builds have _dump_nccl_trace_json)"
            )
        self._labels: dict[tuple[str, int], str] = {}
        self._id_names: dict[tuple[str, str], str | None] = {}
        """(recorder tag, pg_id) -> group name (None: not known). `pg_status` is keyed by a per-process
        counter (pg_id), entries carry both; the same id names different groups on different ranks
        (a device mesh's subgroups), and NCCL and gloo number their groups apart: pg 1 of the NCCL
        recorder and pg 1 of the CPU recorder are two groups (the check's gloo side group beside
        an NCCL subgroup, Megatron's gloo groups)."""
        self._first_seen: dict[tuple[str, str, int], float] = {}
        self._any_enqueued = False
        self.completed_total = -1
        """Sum of completed sequence numbers over every group at the last read (-1: none yet)."""

    def name_by_id(self, tag: str, pg_id: str) -> str | None:
        """The name of the group that recorder `tag`'s `pg_status` calls `pg_id`, or None."""
        key = (tag, pg_id)
        if key not in self._id_names or self._id_names[key] is None:
            self._id_names[key] = _name_by_creation(pg_id, _TAG_BACKENDS.get(tag))
        return self._id_names[key]

    def label_by_id(self, pg_id: str, tag: str = "nccl") -> str:
        """The label of the group that recorder `tag`'s `pg_status` calls `pg_id` in this process."""
        name = self.name_by_id(tag, pg_id)
        return self.label(name) if name is not None else GroupId(name=pg_id).label

    @property
    def available(self) -> bool:
        return bool(self._fns)

    def label(self, name: str) -> str:
        """'world' for the default group, 'ranks[0,1]' for a subgroup, else 'group NAME'."""
        key = (name, groups_made())
        label = self._labels.get(key)
        if label is None:
            label = self._labels[key] = group_label(name)
        return label

    def warm_sites(self) -> None:
        """Make the first (slow) stack dump on a daemon thread, once the recorder holds an entry
        (with none, the call symbolizes nothing and the next one is slow again), and only once
        the symbolizer's module is fully imported: this thread never imports (see SYMBOLIZER)."""
        if self.sites_state != "cold" or self.completed_total <= 0 and not self._any_enqueued:
            return
        if not self._stack_fns:
            self.sites_state = "failed"
            return
        if self._stack_fns_are_torch and loaded(SYMBOLIZER) is None:
            return  # not imported (yet): no call sites from the recorder until it is
        self.sites_state = "warming"

        import threading

        self._warmed = threading.Event()

        def warm() -> None:
            try:
                self._read_sites()
                self.sites_state = "ready"
            except Exception:  # noqa: BLE001 - call sites are detail: the stacks still say where
                self.sites_state = "failed"
            self._warmed.set()

        threading.Thread(target=warm, name="distdiag-recorder-warm", daemon=True).start()

    def _read_sites(self) -> dict[tuple[str, str, int], str]:
        """(backend tag, group name, seq) -> the job's line that issued it, from the stack dumps."""
        from distdiag.hang.dumps import parse_dump

        bind_reader_thread()  # the warm-up runs on a thread of its own

        out: dict[tuple[str, str, int], str] = {}
        for tag, fn in self._stack_fns:
            data = parse_dump(fn(includeCollectives=True, includeStackTraces=True, onlyActive=False), f"{tag} recorder")
            for raw in (data.get("entries") or []) if isinstance(data, dict) else []:
                if isinstance(raw, dict) and not raw.get("is_p2p"):
                    site = entry_site(raw.get("frames"))
                    if site:
                        out[(tag, _pg_name(raw), _int(raw.get("collective_seq_id"), 0))] = site
        return out

    def _sites_or_none(self, wait_s: float) -> dict[tuple[str, str, int], str] | None:
        if self.sites_state == "warming" and self._warmed is not None:
            self._warmed.wait(wait_s)  # a hang in the job's first seconds: the warm-up may be nearly done
        if self.sites_state != "ready" or self._stack_fns_are_torch and loaded(SYMBOLIZER) is None:
            return None
        try:
            return self._read_sites()
        except Exception:  # noqa: BLE001 - a version quirk: no call sites, the rest stands
            return None

    def read(self, *, details: bool = True, tail: int = 0, sites: bool = False, wait_s: float = 0.0) -> dict[str, Any]:
        """This rank's engine view: {"state": ok|off|unavailable, "reason", "groups": [...],
        "entries": [last `tail` entries]}. `details` fetches the pending collectives' entries;
        `sites` adds each entry's call site from the stack dump once `warm_sites` is done,
        waiting up to `wait_s` for it (snapshots only: the dump costs milliseconds, too much
        for every tick)."""
        if not self._fns:
            return {"state": "unavailable", "reason": self.reason, "groups": []}
        bind_reader_thread()
        groups: list[dict[str, Any]] = []
        errors = []
        seen_backends: dict[str, list[str]] = {}
        for tag, fn in self._fns:
            try:
                data = json.loads(fn(False, False))
            except Exception as exc:  # noqa: BLE001 - a backend without a recorder, a version quirk
                errors.append(f"{tag}: {type(exc).__name__}: {exc}")
                continue
            status = data.get("pg_status") if isinstance(data, dict) else None
            if not isinstance(status, dict):
                continue
            for name, st in status.items():
                if isinstance(st, dict):
                    # One group on two backends (cpu:gloo,cuda:nccl) has one name on both
                    # recorders; without a name, the same id on both is taken for one group.
                    same = self.name_by_id(tag, str(name)) or f"id {name}"
                    seen_backends.setdefault(same, []).append(tag)
                    groups.append({**_group_entry(str(name), self.label_by_id(str(name), tag), st, tag), "_same": same})
        if not groups:
            if errors and len(errors) == len(self._fns):
                return {"state": "unavailable", "reason": "; ".join(errors), "groups": []}
            return {"state": "off", "reason": _off_reason(), "groups": []}
        for g in groups:  # one group on two backends: say which is which
            if len(seen_backends.get(g.pop("_same"), [])) > 1:
                g["group"] = parse_label(g["group"]).qualified(g["backend"]).label
        self.completed_total = sum(max(g["completed"], 0) for g in groups)
        self._any_enqueued = any(g["enqueued"] > 0 for g in groups)
        view: dict[str, Any] = {"state": "ok", "groups": groups}
        pending = [g for g in groups if g["enqueued"] > g["completed"]]
        live = {(g["backend"], g["pg"], g["enqueued"]) for g in pending}
        for key in [k for k in self._first_seen if k not in live]:
            del self._first_seen[key]
        now = time.monotonic()
        for key in live:
            self._first_seen.setdefault(key, now)
        entries: list[dict[str, Any]] = []
        if (pending and details) or tail:
            entries = self._entries(only_active=not tail)
            site_of = (self._sites_or_none(wait_s) if sites and entries else None) or {}
            for e in entries if site_of else []:
                e["call_site"] = site_of.get((e["backend_tag"], e["pg"], e["seq"]))
        if pending:
            self._attach_all(pending, entries)
        if tail:
            view["entries"] = [{k: v for k, v in e.items() if k != "backend_tag"} for e in entries[-tail:]]
        return view

    def _attach_all(self, pending: list[dict[str, Any]], entries: list[dict[str, Any]]) -> None:
        """Each pending group's collective (recorder._inside_seq), with its entry where read."""
        by_key = {(e["backend_tag"], e["pg_id"] or e["pg"], e["seq"]): e for e in entries}
        open_seqs: dict[tuple[str, str], list[int]] = {}
        for e in entries:
            if e.get("state") != "completed":
                open_seqs.setdefault((e["backend_tag"], e["pg_id"] or e["pg"]), []).append(e["seq"])
        now_ns = time.time_ns()
        for g in pending:
            key = (g["backend"], g["pg"], g["enqueued"])
            seq = _inside_seq(g, open_seqs)
            _attach_pending(g, by_key.get((g["backend"], g["pg"], seq)), now_ns, self._first_seen.get(key), seq)

    def _entries(self, only_active: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for tag, fn in self._fns:
            try:
                data = json.loads(fn(True, only_active))
            except Exception:  # noqa: BLE001 - entries are detail; the status stands without them
                continue
            for raw in (data.get("entries") or []) if isinstance(data, dict) else []:
                if not isinstance(raw, dict) or raw.get("is_p2p"):
                    continue
                c = compact_entry(raw, self.label(_pg_name(raw)))
                if c["pg_id"]:
                    self._id_names[(tag, c["pg_id"])] = c["pg"]  # the entry says it: it wins over creation order
                c["backend_tag"] = tag
                out.append(c)
        out.sort(key=lambda c: c["created_ns"])
        return out


def _off_reason() -> str:
    raw = os.environ.get(FR_BUFFER_ENV) or os.environ.get(_LEGACY_BUFFER_ENV)
    how = f"{FR_BUFFER_ENV}={raw}" if raw is not None else "this torch's default"
    return (
        f"torch's flight recorder is off ({how}), so collectives torch issues itself (DDP, FSDP, compiled graphs, "
        f"NCCL) are not seen; set {FR_BUFFER_ENV}=2000 before init_process_group (python -m distdiag.watch does)"
    )


def loaded(name: str) -> ModuleType | None:
    """`sys.modules[name]` when it and every parent package have finished importing, else None;
    runs no import and takes no import lock. Our threads (the watchdog's tick, the recorder's
    warm-up) use it instead of an import: while the training thread is inside a long first import
    (dynamo, inductor), a second thread importing on the same chain takes module locks in
    another order, and importlib's deadlock avoidance hands one of them a partially initialised
    module, raised in the user's code."""
    parts = name.split(".")
    module = None
    for i in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is None:
            return None
        # importlib sets spec._initializing while a module's body runs (the flag behind its
        # "partially initialized module" message)
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            return None
    return module


def load_symbolizer() -> bool:
    """Import SYMBOLIZER on the calling thread (the training thread, before the watchdog's threads
    start), so that the recorder's stacks can be read later without an import. False, with the
    recorder's call sites off, where it cannot be imported."""
    if loaded(SYMBOLIZER) is not None:
        return True
    try:
        import importlib

        importlib.import_module(SYMBOLIZER)
    except Exception:  # noqa: BLE001 - a torch without inductor: the wrappers give call sites
        return False
    return True


def group_label(name: str) -> str:
    """A process group's label by its name: 'world', 'ranks[0,1]', else 'group NAME' (the
    watchdog's wrappers, the check's and the recorder's positions use the same labels, so they
    match). A group with a twin in this process (another group of the same members: Megatron's
    data-parallel group beside its context-parallel one of size 1, two `new_group` calls of the
    same ranks) is told apart as the dumps tell it: by torch's desc, and by its group name where
    the twin has the same desc: 'ranks[0,1] (dp)', 'ranks[0,1] (group 5)'. Every member has both
    twins, so every member gives the same label; a label depends on the groups made so far
    (`groups_made`: callers that keep labels key them by it)."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        pg = c10d._resolve_process_group(name)  # type: ignore[arg-type]  # torch's GroupName: a NewType of str
        default = c10d._get_default_group()
        if pg is default:
            return GroupId(world=True).label
        members = tuple(dist.get_process_group_ranks(pg))
        twins = [q for q in list(c10d._world.pg_map) if q is not pg and q is not default
                 and tuple(dist.get_process_group_ranks(q)) == members]
        if not twins:
            return GroupId(members).label
        desc = shown_desc(str(getattr(pg, "group_desc", "") or ""))
        named = any(shown_desc(str(getattr(q, "group_desc", "") or "")) == desc for q in twins)
        return GroupId(members, desc, str(pg.group_name) if named else "").label
    except Exception:  # noqa: BLE001 - a label only
        return GroupId(name=name).label


_C10D: Any = None


def groups_made() -> int:
    """How many process groups this process has made (0 before any): a label cache's key beside
    the group, since a twin made later changes a group's label (`group_label`)."""
    global _C10D
    try:
        if _C10D is None:
            from torch.distributed import distributed_c10d

            _C10D = distributed_c10d
        return len(_C10D._world.pg_map)
    except Exception:  # noqa: BLE001 - no torch.distributed: no groups
        return 0


_TAG_BACKENDS = {"nccl": "nccl", "fr": "gloo"}
"""The backend whose groups each recorder numbers: NCCL's recorder NCCL's groups, the CPU
recorder (`fr`) gloo's."""


def _name_by_creation(pg_id: str, backend: str | None = None) -> str | None:
    """The name of this process's `pg_id`-th process group of `backend` (every group when None):
    each backend numbers the groups it serves in creation order (0: the first; the default group
    when it runs on that backend), the order of c10d's group map."""
    try:
        from torch.distributed import distributed_c10d as c10d

        groups = [pg for pg, (kind, _) in c10d._world.pg_map.items() if backend is None or backend in str(kind)]
        index = int(pg_id)
        return str(groups[index].group_name) if 0 <= index < len(groups) else None
    except Exception:  # noqa: BLE001 - a label only
        return None


def positions_from_dump(dump: dict[str, Any]) -> dict[str, Any]:
    """An engine view (as `EngineReader.read` returns) from one rank's dump, read alone.

    Groups are labelled by their members (pg_config), or by the ranks the dump itself shows
    (distdiag/hang/dumpgroups.py); `distdiag hang-report` reads all ranks' dumps together
    (distdiag/hang/dumpreport.py). Raises ValueError for a dump that is not one.
    """
    from distdiag.hang.dumpgroups import engine_view, infer_members, normalise, world_of

    if not isinstance(dump, dict):
        raise ValueError("not a flight-recorder dump (expected a JSON object)")
    entries = dump.get("entries")
    if entries is not None and not isinstance(entries, list | tuple):
        raise ValueError("not a flight-recorder dump ('entries' is not a list)")
    rank: int = dump["rank"] if isinstance(dump.get("rank"), int) else 0
    rd = normalise(rank, {**dump, "entries": [e for e in entries or [] if isinstance(e, dict)]})
    world = world_of({rank: rd})
    infer_members({rank: rd}, world)
    return engine_view(rd, world)
