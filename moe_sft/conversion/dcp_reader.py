"""Regions of the global tensors in a torch_dist checkpoint, read on one process, no process group.

A megatron `torch_dist` checkpoint is a torch.distributed.checkpoint (DCP) directory: `.metadata`
lists, for every ShardedTensor key, its global shape, dtype and the chunks that tile it (each the
part one rank saved, or one of the converter's chunks), and where each chunk's bytes are
(`__<rank>_<n>.distcp` files, one `torch.save` per chunk). `read(key, offsets, sizes)` fills one
box of one global tensor with DCP's own machinery: `create_read_items_for_chunk_list` computes the
overlaps with the stored chunks (the resharding algorithm `dcp.load` uses) and
`FileSystemReader.read_data` loads each overlapping chunk and copies its overlap into the
destination, which may be a strided view of a caller's buffer. Memory: the destination plus the
one stored chunk being copied from. Nothing else of the checkpoint is touched.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from moe_sft.conversion.file_io import OpenFiles
from moe_sft.conversion.hf_reader import CheckpointError
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)
_MAX_READ = 1 << 30  # one preadv call reads at most ~2 GiB on Linux; stay well below
_MAX_BUFFERS = 1024  # IOV_MAX
# What torch.load / pickle raise on a truncated or overwritten file.
_DAMAGED = (EOFError, OSError, RuntimeError, ValueError, pickle.UnpicklingError)


def _contiguous_blocks(target: torch.Tensor) -> list[torch.Tensor] | None:
    """`target` as contiguous blocks in row-major order (target[i, j, ...] for its leading
    indices), when the blocks are at most 4096 and not smaller than 64 elements; else None."""
    lead = 0
    while lead < target.dim() and not target[(0,) * lead].is_contiguous():
        lead += 1
    count = torch.Size(target.shape[:lead]).numel()
    if count > 4096 or (count > 1 and target.numel() // count < 64):
        return None
    return [target[idx] for idx in itertools.product(*map(range, target.shape[:lead]))]


def _skip(views: list[memoryview], done: int) -> list[memoryview]:
    """What is left of `views` after the first `done` bytes."""
    out = []
    for view in views:
        cut = min(done, len(view))
        done -= cut
        if cut < len(view):
            out.append(view[cut:])
    return out


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint lacks a tensor, or the stored chunks do not cover a region that is needed."""


def _damaged(file: Path, err: BaseException, key: str | None = None) -> str:
    reading = f" reading {key!r}" if key else ""
    return (
        f"{file} is damaged (truncated or overwritten):{reading} {type(err).__name__}: "
        f"{' '.join(str(err).split())[:160] or 'no details'}; restore the checkpoint from an intact copy "
        "(or export an earlier step)"
    )


class _IntoView(LoadPlanner):
    """DCP's read_data calls back `resolve_tensor` for where each overlap goes: a box of `dest`."""

    def __init__(self, dest: torch.Tensor):
        self.dest = dest

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.dest
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of dest: the copy already landed

    def load_bytes(self, read_item, value) -> None:
        raise RuntimeError("only tensors are read")

    def set_up_planner(self, *args, **kwargs) -> None:
        raise NotImplementedError("used for read_data callbacks only")

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError("used for read_data callbacks only")

    def create_global_plan(self, global_plan):
        raise NotImplementedError("used for read_data callbacks only")

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError("used for read_data callbacks only")


@dataclasses.dataclass(frozen=True)
class _Stored:
    """A stored chunk's tensor as `torch.save` laid it out: its storage's bytes start at `at`."""

    file: Path
    at: int
    tensor: torch.Tensor  # on the meta device: shape, stride, storage offset, dtype


class DistCheckpointReader:
    """Read boxes of global tensors from the DCP directory `path`.

    Each overlap with a stored chunk is read straight from the file into the destination
    (`os.preadv` of just the rows it needs, at the offset `torch.load(map_location="meta")`
    reports for the chunk's storage), so a stored chunk is never loaded whole; chunks that DCP
    stored through an extension (compression, ...) go through DCP's `read_data` instead.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise IncompleteCheckpointError(
                f"{self.path}: no .metadata; not a complete torch_dist checkpoint (an interrupted save leaves none)"
            )
        self._storage = FileSystemReader(str(self.path))
        try:
            self.metadata = self._storage.read_metadata()
        except _DAMAGED as err:
            raise IncompleteCheckpointError(_damaged(self.path / ".metadata", err)) from err
        self._storage.set_up_storage_reader(self.metadata, is_coordinator=True)
        self._stored: dict = {}
        self._files = OpenFiles()
        self.tensor_bytes = 0  # bytes placed into destinations
        self.file_bytes = 0  # bytes read from the files to do it

    def tensors(self) -> dict[str, TensorStorageMetadata]:
        """Every tensor key with its global size, dtype and stored chunks (byte objects left out)."""
        return {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def read_into(self, key: str, offsets, dest: torch.Tensor) -> None:
        """Fill `dest` (any strided tensor) with the box of global tensor `key` at `offsets`."""
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise IncompleteCheckpointError(f"{self.path}: checkpoint has no tensor {key!r}")
        box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(dest.shape))
        if len(box.offsets) != len(md.size) or any(o + s > n for o, s, n in zip(box.offsets, box.sizes, md.size)):
            raise IncompleteCheckpointError(
                f"{self.path}: {key!r} has shape {tuple(md.size)}; the "
                f"model needs the box at {tuple(box.offsets)} of size "
                f"{tuple(box.sizes)}"
            )
        if md.properties.dtype != dest.dtype:
            raise TypeError(f"{key!r} is stored as {md.properties.dtype}, destination is {dest.dtype}")
        items = create_read_items_for_chunk_list(key, md, [box])
        covered = sum(torch.Size(item.lengths).numel() for item in items)
        if covered != dest.numel():  # stored chunks never overlap (DCP checks at save)
            raise IncompleteCheckpointError(
                f"{self.path}: the stored chunks of {key!r} cover {covered} of the {dest.numel()} "
                f"elements of the box at {tuple(box.offsets)} of size {tuple(box.sizes)}; the "
                "checkpoint is incomplete (a rank's files missing from .metadata?)"
            )
        planner = _IntoView(dest)
        slow = [item for item in items if not self._read_item(item, planner.resolve_tensor(item))]
        if slow:
            try:
                self._storage.read_data(LoadPlan(slow), planner).wait()
            except _DAMAGED as err:
                files = sorted({self.metadata.storage_data[item.storage_index].relative_path for item in slow})
                raise IncompleteCheckpointError(_damaged(self.path / files[0], err, key)) from err
            self.file_bytes += (
                sum(md.chunks[item.storage_index.index].sizes.numel() for item in slow) * dest.element_size()
            )
        self.tensor_bytes += dest.numel() * dest.element_size()

    def _read_item(self, item: ReadItem, target: torch.Tensor) -> bool:
        """Read one overlap into `target` from the file; False if it must go through DCP."""
        stored = self._stored_tensor(item)
        if stored is None or stored.tensor.dtype != target.dtype:
            return False
        t, size = stored.tensor, target.element_size()
        first = t.storage_offset() + sum(o * st for o, st in zip(item.storage_offsets, t.stride()))
        span = 1 + sum((n - 1) * st for n, st in zip(item.lengths, t.stride()))
        blocks = _contiguous_blocks(target)
        if t.is_contiguous() and span == target.numel() and blocks is not None:
            # the overlap is whole rows of the stored chunk: one read scattered into the blocks
            self._pread(stored.file, blocks, stored.at + first * size)
        else:  # the bytes the overlap spans, then its strided view of them
            raw = torch.empty(span * size, dtype=torch.uint8)
            self._pread(stored.file, [raw], stored.at + first * size)
            target.copy_(raw.view(target.dtype).as_strided(tuple(item.lengths), t.stride(), 0))
        self.file_bytes += span * size
        return True

    def _stored_tensor(self, item: ReadItem) -> _Stored | None:
        info = self.metadata.storage_data[item.storage_index]
        where = (info.relative_path, info.offset)
        if where not in self._stored:
            self._stored[where] = None
            if not getattr(info, "transform_descriptors", None):
                try:
                    self._stored[where] = self._locate(info)
                except Exception as err:  # an unexpected layout: DCP's own reader handles it
                    log.debug("%s: reading %s through DCP (%s)", self.path, where, err)
        return self._stored[where]

    def _locate(self, info) -> _Stored | None:
        file = self.path / info.relative_path
        with open(file, "rb") as stream:
            view = self._storage._slice_file(stream, info)
            tensor = torch.load(view, map_location="meta", weights_only=True)
            view.seek(0)
            archive = torch._C.PyTorchFileReader(view)  # torch.save records the saver's byte order
            if archive.has_record("byteorder") and bytes(archive.get_record("byteorder")).decode() != sys.byteorder:
                return None
        if not isinstance(tensor, torch.Tensor):
            return None
        at = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)  # set by a meta load
        if at is None:
            return None
        return _Stored(file, info.offset + at, tensor)

    def _pread(self, file: Path, blocks: list[torch.Tensor], offset: int) -> None:
        """Consecutive bytes of `file` from `offset` into the blocks (contiguous tensors), in order."""
        views = [memoryview(b.as_strided((b.numel(),), (1,)).view(torch.uint8).numpy()) for b in blocks]
        while views:
            batch, size = [], 0
            while views and len(batch) < _MAX_BUFFERS and size < _MAX_READ:
                take = views[0][: _MAX_READ - size]
                batch.append(take)
                size += len(take)
                views[0] = views[0][len(take) :]
                if not len(views[0]):
                    views.pop(0)
            done = os.preadv(self._files.fd(file), batch, offset)
            if done < size:
                if done <= 0:
                    raise IncompleteCheckpointError(
                        f"{file}: ends at byte {offset}, {size} bytes short; the file is truncated"
                    )
                views = _skip(batch, done) + views  # a short read: go on from where it stopped
            offset += done

    def close(self) -> None:
        self._files.close()
