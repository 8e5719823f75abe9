"""Reading a torch.distributed.checkpoint (DCP) directory without running code from it.

DCP's own reader is not safe on untrusted input: `FileSystemReader.read_metadata`
unpickles `.metadata` with plain `pickle`, its default load planner reads non-tensor
items with `torch.load(weights_only=False)`, and the shard paths in `.metadata` are
joined to the directory unchecked (`../../step-00000030/dcp/__0_0.distcp` reads another
checkpoint). Here:

* `read_metadata` unpickles with an allow-list of DCP's metadata types (no other global
  can be named, so no callable outside the list can run), caps the size, and then checks
  every field: names, shapes, chunk bounds, and that every storage entry is a plain file
  name in the same directory, a regular file, with its byte range inside it. Rank-local
  metadata files (`__N.metadata`) are never read.
* `ConfinedReader` serves DCP only that checked metadata.
* `WeightsOnlyLoadPlanner` and `WeightsOnlyFullPlanner` load non-tensor items (learning
  rates, betas) with `weights_only=True`.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from reference_impl.checkpoint.files import CheckpointError, need, open_regular, read_bounded

METADATA = ".metadata"
# A 405B model sharded over thousands of ranks lists millions of chunks; a gigabyte of
# metadata is far beyond any real one, and bounds what a crafted file can make us parse.
METADATA_CAP = 1 << 30
_METADATA_CLASSES = (Metadata, TensorStorageMetadata, TensorProperties, ChunkStorageMetadata,
                     BytesStorageMetadata, MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING, _StorageInfo)
_ALLOWED: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in _METADATA_CLASSES}
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a name -> torch.layout lookup
_ALLOWED[("pathlib", "PosixPath")] = Path  # StorageMeta.checkpoint_id: a path that is never opened


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata types, `torch.Size`, layouts and dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata type")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(type(d) is int and d >= 0 for d in value)


def _check_tensor(fqn: str, md: Any) -> None:
    props = md.properties
    need(isinstance(props, TensorProperties) and isinstance(props.dtype, torch.dtype)
         and _is_size(md.size) and isinstance(md.chunks, list),
         f"{METADATA} describes {fqn!r:.80} with malformed properties")
    for chunk in md.chunks:
        need(isinstance(chunk, ChunkStorageMetadata) and _is_size(chunk.offsets) and _is_size(chunk.sizes)
             and len(chunk.offsets) == len(chunk.sizes) == len(md.size)
             and all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size, strict=True)),
             f"{METADATA} has a chunk of {fqn!r:.80} outside its tensor")


def _check_volume(fqn: str, md: TensorStorageMetadata, storage: dict[Any, Any]) -> None:
    """The chunks tile the tensor, and each chunk's bytes fit in what it stores.

    A size is allocated before anything is read (a whole-model export allocates every
    tensor), so a crafted `size` of 10**12 elements must fail here, against bytes on disk.
    """
    need(sum(math.prod(c.sizes) for c in md.chunks) == math.prod(md.size),
         f"{METADATA}: the chunks of {fqn!r:.80} do not cover its {tuple(md.size)} elements")
    itemsize = md.properties.dtype.itemsize
    for chunk in md.chunks:
        info = storage[MetadataIndex(fqn, chunk.offsets)]
        need(math.prod(chunk.sizes) * itemsize <= info.length,
             f"{METADATA}: a chunk of {fqn!r:.80} claims more bytes than it stores")


def _check_storage(index: Any, info: Any, sizes: dict[str, int]) -> None:
    need(isinstance(index, MetadataIndex) and isinstance(index.fqn, str), f"{METADATA} has a malformed storage key")
    need(isinstance(info, _StorageInfo) and isinstance(info.relative_path, str),
         f"{METADATA} has a malformed storage entry for {index.fqn!r:.80}")
    need(info.relative_path in sizes,  # a plain name of a regular file in this directory, nothing else
         f"{METADATA} points {index.fqn!r:.80} at {info.relative_path!r:.120}, not a file of this directory")
    need(type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0
         and info.offset + info.length <= sizes[info.relative_path],
         f"{METADATA} points {index.fqn!r:.80} past the end of {info.relative_path}")
    need(not info.transform_descriptors, f"{METADATA} asks for stream transforms this trainer never writes")


def check_metadata(metadata: Any, sizes: dict[str, int]) -> Metadata:
    """Check every field a load reads; `sizes` maps each file that may be read to its size.

    Raises:
        CheckpointError: Naming the first malformed field.
    """
    need(isinstance(metadata, Metadata), f"{METADATA} does not hold DCP metadata")
    items, storage = metadata.state_dict_metadata, metadata.storage_data
    need(isinstance(items, dict) and isinstance(storage, dict), f"{METADATA} lacks its item or storage tables")
    for fqn, md in items.items():
        need(isinstance(fqn, str), f"{METADATA} has a non-string key")
        if isinstance(md, TensorStorageMetadata):
            _check_tensor(fqn, md)
            keys = [MetadataIndex(fqn, chunk.offsets) for chunk in md.chunks]
        else:
            need(isinstance(md, BytesStorageMetadata), f"{METADATA} describes {fqn!r:.80} with an unknown type")
            keys = [MetadataIndex(fqn)]
        need(all(k in storage for k in keys), f"{METADATA} stores no bytes for {fqn!r:.80}")
    for index, info in storage.items():
        _check_storage(index, info, sizes)
    for fqn, md in items.items():
        if isinstance(md, TensorStorageMetadata):
            _check_volume(fqn, md, storage)
    mappings = metadata.planner_data  # key paths; only names (an integer index would grow a list to it)
    need(mappings is None or (isinstance(mappings, dict) and all(
        isinstance(k, str) and isinstance(v, tuple) and v and all(isinstance(p, str) for p in v)
        for k, v in mappings.items())), f"{METADATA} has malformed key paths")
    metadata.storage_meta = StorageMeta()  # the saved one names the writer's paths: not ours to keep
    return metadata


def read_metadata(directory: Path) -> Metadata:
    """The checked metadata of the DCP directory `directory`, unpickled without running code.

    Raises:
        CheckpointError: The file is unsafe, malformed, or points outside `directory`.
    """
    data = read_bounded(directory / METADATA, METADATA_CAP)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any refusal or damage: one line, never the pickle's own code
        raise CheckpointError(f"{METADATA} refused: {type(exc).__name__}: {str(exc)[:200]}") from None
    sizes = {}
    for path in directory.iterdir():
        if path.name != METADATA and not path.is_symlink() and path.is_file():
            sizes[path.name] = path.stat().st_size
    return check_metadata(metadata, sizes)


def storage_files(metadata: Metadata) -> set[str]:
    """The file names (relative to the DCP directory) that the checked metadata reads."""
    return {info.relative_path for info in metadata.storage_data.values()}


def load_item(value: io.BytesIO, fqn: str) -> Any:
    """One non-tensor item (a learning rate, betas), loaded weights-only.

    Raises:
        CheckpointError: The bytes hold anything but tensors and plain values.
    """
    try:
        return torch.load(value, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{fqn!r:.80} in {METADATA}'s shards refused by the weights-only loader: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}") from None


def check_plain_items(directory: Path, metadata: Metadata) -> None:
    """Load every non-tensor item of a checked DCP directory weights-only (they are small).

    Raises:
        CheckpointError: One is refused, or its bytes cannot be read.
    """
    by_file: dict[str, list[tuple[str, _StorageInfo]]] = {}
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
            by_file.setdefault(info.relative_path, []).append((index.fqn, info))
    seen: set[bytes] = set()  # every parameter repeats the same lr, betas, eps...: load each form once
    for name, items in by_file.items():
        fd = open_regular(directory / name)
        try:
            for fqn, info in items:
                data = os.pread(fd, info.length, info.offset)
                if data not in seen:
                    load_item(io.BytesIO(data), fqn)
                    seen.add(data)
        finally:
            os.close(fd)


class ConfinedReader(FileSystemReader):
    """DCP's file reader, given only metadata that `read_metadata` checked.

    Its `read_metadata` takes no `rank` argument, so DCP never falls back to rank-local
    metadata files; each shard it opens is checked to be a regular file, never a link.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:  # no `rank` argument: no rank-local fallback
        if self._metadata is None:
            self._metadata = read_metadata(Path(self.path))
        self._metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        for name in {self.storage_data[item.storage_index].relative_path for item in plan.items}:
            os.close(open_regular(Path(self.path) / name))  # swapped for a link or a FIFO since the check?
        return super().read_data(plan, planner)


class _WeightsOnlyBytes(DefaultLoadPlanner):
    """`load_bytes` as DCP's default planner does it, with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_item(value, read_item.dest_index.fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class WeightsOnlyLoadPlanner(_WeightsOnlyBytes):
    """DCP's default load planner (into an existing state dict), safe for non-tensor items."""


class WeightsOnlyFullPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole saved state dict from the metadata (export), safe for non-tensor items."""
