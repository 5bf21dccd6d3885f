"""Reading a DCP checkpoint without running code from it.

DCP's `FileSystemReader.read_metadata` unpickles `DIR/.metadata` with plain pickle, and its
`DefaultLoadPlanner.load_bytes` reads non-tensor entries of the `.distcp` files with
`torch.load(weights_only=False)`: a crafted checkpoint directory runs code on every rank
that loads it. The checkpoint probe reads both through restrictions instead:

- `.metadata` through `RestrictedUnpickler`, which admits only what DCP's metadata is made of
  (torch 2.13: the dataclasses of torch.distributed.checkpoint.metadata, the filesystem
  writer's `_StorageInfo`, `torch.Size`, dtypes, layouts by name, paths, builtin containers);
- byte entries through `torch.load(weights_only=True)` (tensors are already read that way).

Anything else is refused with `RefusedPickle`, naming what was refused. `trust_pickle=True`
(`[probes.checkpoint] trust_pickle = true`) reads both with plain pickle, as DCP does.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from distdiag.errors import DistDiagError

__all__ = ["RefusedPickle", "RestrictedUnpickler", "load_metadata", "SafeFileSystemReader", "SafeLoadPlanner", "ALLOWED"]

TRUST_KEY = "probes.checkpoint.trust_pickle"

ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    # torch pickles a layout as a call of this lookup by name (a dict read, nothing else).
    "torch.serialization": frozenset({"_get_layout"}),
    # StorageMeta.checkpoint_id: building a path object touches no file.
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict"}),
    "collections": frozenset({"OrderedDict"}),
}
"""module -> names `.metadata` may reference, besides torch's dtypes (torch.float32, ...)."""

_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


class RefusedPickle(DistDiagError, pickle.UnpicklingError):
    """A checkpoint file references something the restricted reader does not admit."""

    def __init__(self, what: str, where: str) -> None:
        super().__init__(
            f"distdiag refuses to unpickle {what} from {where} (unpickling runs code; DCP metadata is made of "
            f"torch.distributed.checkpoint classes, torch.Size, dtypes and builtin containers); set "
            f"[probes.checkpoint] trust_pickle = true if you trust the checkpoint"
        )
        self.what, self.where = what, where

    def __reduce__(self) -> Any:
        # DCP gathers a rank's exception to every rank (pickled): rebuild it from what and where.
        return (type(self), (self.what, self.where))


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose `find_class` admits only `ALLOWED` and torch dtypes."""

    def __init__(self, file: BinaryIO, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()) or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise RefusedPickle(f"{module}.{name}", self.where)

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle(f"a persistent id ({type(pid).__name__})", self.where)


def load_metadata(stream: BinaryIO, where: str, trust_pickle: bool = False) -> Any:
    """A checkpoint's `.metadata` object, unpickled with restrictions unless trusted."""
    from torch.distributed.checkpoint.metadata import Metadata

    if trust_pickle:
        return pickle.load(stream)
    metadata = RestrictedUnpickler(stream, where).load()
    if not isinstance(metadata, Metadata):
        raise RefusedPickle(f"a {type(metadata).__name__} where DCP's Metadata belongs", where)
    return metadata


def metadata_path(reader: FileSystemReader, rank: int | None = None) -> Any:
    """Where a FileSystemReader reads its metadata (DCP's private helper when this torch has it)."""
    helper = getattr(reader, "_get_metadata_path", None)
    if helper is not None:
        return helper(rank)
    return os.path.join(str(reader.path), ".metadata" if rank is None else f"__{rank}.metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with `read_metadata` through `load_metadata` (restricted)."""

    def __init__(self, path: str | os.PathLike[str], trust_pickle: bool = False) -> None:
        super().__init__(path)
        self.trust_pickle = trust_pickle

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.trust_pickle:
            return super().read_metadata(*args, **kwargs)
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = metadata_path(self, kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, str(path))  # type: ignore[arg-type]  # torch says IOBase; "rb": binary
        # What FileSystemReader.read_metadata does after unpickling.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, whose non-tensor (byte) entries must pass `weights_only=True` first.

    DefaultLoadPlanner.load_bytes unpickles them with `torch.load(weights_only=False)`. Here
    the bytes are read once with torch's weights-only unpickler (tensors, numbers, strings,
    containers); only what it admits is handed on, so the plain load that follows meets no
    global the weights-only one refused.
    """

    def __init__(self, *args: Any, trust_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trust_pickle = trust_pickle

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if not self.trust_pickle:
            data = value.read()
            where = f"the checkpoint entry {read_item.dest_index.fqn}"
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except pickle.UnpicklingError as exc:
                raise RefusedPickle(_refused_global(exc), where) from None
            value = io.BytesIO(data)
        super().load_bytes(read_item, value)


def _refused_global(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused, from its message ('... GLOBAL posix.mkdir ...')."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return found.group(1) if found else "an object torch's weights-only unpickler does not admit"
