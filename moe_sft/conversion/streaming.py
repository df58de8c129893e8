"""Write megatron's torch_dist checkpoint with tensors made on demand: memory is a few chunks.

The in-memory converter built the whole single-rank GPTModel (1.3 TB for DeepSeek-V3) only to
hand megatron its `sharded_state_dict()`. Here the model is built on the `meta` device: every
parameter has its name, shape and dtype but no storage, so its `sharded_state_dict()` still says
exactly which global tensors, keys, shapes, offsets and shards megatron writes and later loads.
Megatron's own `dist_checkpointing.save` runs unchanged (factories, validation, `common.pt`,
`metadata.json`) with a save strategy of ours for the tensors, which:

1. records, for every ShardedTensor, which element range of which parameter it shows. Factories
   (GroupedMLP's per-expert split) run on meta tensors with `.contiguous()` made a no-op, so their
   outputs stay *views* of the parameter whose (shape, stride, offset) we read;
2. plans the torch.distributed.checkpoint write with megatron's own planner, splitting any item
   above `max_chunk_bytes` along its first axis into several chunks (DCP stores a global tensor as
   any set of chunks that tiles it; loading at any layout reads the overlaps);
3. writes chunk after chunk: each is produced from the HF tensors it needs (tensor_source.py),
   serialised exactly as DCP's FileSystemWriter does (`torch.save` per item, same `_StorageInfo`),
   and dropped before the next. `.metadata` is DCP's own Metadata from the planner.

Several processes, on one node or several, can write disjoint shares of the chunks; each re-plans
the same way (the plan is deterministic and checked by digest), writes its own
`__{worker}_{n}.distcp` files and hands back its write results; the coordinator writes `.metadata`
from all of them (workers.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from moe_sft.conversion import completeness, workers
from moe_sft.conversion.meta_model import MetaViewsStayViews, View, view_of
from moe_sft.conversion.tensor_source import TensorSource
from moe_sft.conversion.workers import WorkerSpec
from moe_sft.runtime.logs import get_logger

log = get_logger(__name__)

DEFAULT_MAX_CHUNK_BYTES = 256 * 2**20
MAX_FILE_BYTES = 16 * 2**30  # a worker starts a new .distcp file past this size


# ------------------------------------------------------------------------------------------------
# DCP planner and writer
# ------------------------------------------------------------------------------------------------


def _split(item: WriteItem, view: View, max_bytes: int) -> tuple[int, list[WriteItem]]:
    """(axis, chunks): the item cut along its first axis longer than 1 into chunks whose source
    (the parameter elements they span, `view.stride[axis]` per slice) is at most `max_bytes`."""
    chunk = item.tensor_data.chunk
    sizes, offsets = tuple(chunk.sizes), tuple(chunk.offsets)
    axis = next((a for a, n in enumerate(sizes) if n > 1), None)
    itemsize = torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
    if axis is None:
        return 0, [item]
    slice_bytes = itemsize * max(torch.Size(sizes[axis + 1 :]).numel(), view.stride[axis])
    if sizes[axis] * slice_bytes <= max_bytes:
        return 0, [item]
    step = max(1, max_bytes // slice_bytes)
    out = []
    for start in range(0, sizes[axis], step):
        stop = min(start + step, sizes[axis])
        sub_offsets = list(offsets)
        sub_offsets[axis] += start
        sub_sizes = list(sizes)
        sub_sizes[axis] = stop - start
        sub = ChunkStorageMetadata(offsets=torch.Size(sub_offsets), sizes=torch.Size(sub_sizes))
        out.append(
            WriteItem(
                index=MetadataIndex(item.index.fqn, sub.offsets),
                type=item.type,
                tensor_data=TensorWriteData(
                    chunk=sub, properties=item.tensor_data.properties, size=item.tensor_data.size
                ),
            )
        )
    return axis, out


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return 0
    props = item.tensor_data.properties
    return item.tensor_data.chunk.sizes.numel() * torch.empty((), dtype=props.dtype).element_size()


def _planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    class StreamingPlanner(MCoreSavePlanner):
        """megatron's save planner; big items become several chunks; data resolved on demand."""

        def __init__(self, views: dict, source: TensorSource, max_chunk_bytes: int):
            super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
            self._views, self._source, self._max = views, source, max_chunk_bytes
            self._chunk_views: dict[MetadataIndex, View] = {}

        def create_local_plan(self) -> SavePlan:
            plan = super().create_local_plan()
            items = []
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    items.append(item)
                    continue
                base = tuple(item.tensor_data.chunk.offsets)
                view = self._views[(item.index.fqn, base)]
                axis, subs = _split(item, view, self._max)
                for sub in subs:
                    if len(subs) > 1:
                        start = sub.tensor_data.chunk.offsets[axis] - base[axis]
                        stop = start + sub.tensor_data.chunk.sizes[axis]
                        self._chunk_views[sub.index] = view.rows(axis, start, stop)
                    else:
                        self._chunk_views[sub.index] = view
                    items.append(sub)
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def view(self, item: WriteItem) -> View:
            return self._chunk_views[item.index]

        def resolve_data(self, write_item: WriteItem):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            view = self._chunk_views[write_item.index]
            lo, hi = view.span()
            if view.literal is not None:  # a tensor megatron made itself (not a parameter)
                flat = view.literal[lo:hi]
            else:
                flat = self._source.flat_range(view.param, lo, hi)
            data = flat.as_strided(view.shape, view.stride, flat.storage_offset() + view.offset - lo)
            data = data.contiguous()
            if data.untyped_storage().nbytes() != data.nbytes:  # torch.save writes whole storages
                data = data.clone()
            return data

    return StreamingPlanner


class _StreamingWriter(FileSystemWriter):
    """DCP's FileSystemWriter writing a given share of the items, one at a time, in order."""

    def __init__(self, path, worker: int = 0, progress: Callable[[int], None] | None = None):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self._worker, self._progress = worker, progress

    def write_data(self, plan: SavePlan, planner) -> Future:
        future: Future = Future()
        future.set_result(self.write_items(plan.items, planner))
        return future

    def write_items(self, items: list[WriteItem], planner) -> list[WriteResult]:
        results, file_index, stream, name = [], 0, None, None
        try:
            for item in items:
                if stream is None or stream.tell() > MAX_FILE_BYTES:
                    self._close(stream)
                    name = f"__{self._worker}_{file_index}.distcp"
                    stream = open(Path(self.path) / name, "wb")
                    file_index += 1
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    torch.save(data, stream)  # what DCP's FileSystemWriter writes per tensor item
                length = stream.tell() - offset
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
                )
                del data
                if self._progress is not None:
                    self._progress(length)
        finally:
            self._close(stream)
        return results

    def _close(self, stream) -> None:
        if stream is not None:
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())
            stream.close()


def _shares(items: list[WriteItem], order: Callable[[WriteItem], tuple], workers: int):
    """Items sorted (each parameter's chunks in a row), cut into `workers` runs of ~equal bytes."""
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=order)
    total = sum(_item_bytes(i) for i in tensors)
    shares: list[list[WriteItem]] = [[] for _ in range(workers)]
    shares[0].extend(byte_items)
    done = 0
    for item in tensors:
        w = min(workers - 1, done * workers // max(total, 1))
        shares[w].append(item)
        done += _item_bytes(item)
    return shares


def _digest(items: list[WriteItem]) -> str:
    h = hashlib.sha256()
    for item in items:
        chunk = item.tensor_data.chunk if item.tensor_data else None
        h.update(
            repr(
                (item.index.fqn, tuple(chunk.offsets) if chunk else None, tuple(chunk.sizes) if chunk else None)
            ).encode()
        )
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------
# The save strategy megatron calls
# ------------------------------------------------------------------------------------------------


def _strategy_class():
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy

    class StreamingSaveStrategy(SaveShardedStrategy):
        """torch_dist (version 1) like megatron's TorchDistSaveShardedStrategy, data on demand."""

        def __init__(
            self,
            params: dict[int, str],
            source: TensorSource,
            order: dict[str, int],
            max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
            workers: WorkerSpec = None,
            progress: Callable[[int, int], None] | None = None,
        ):
            super().__init__("torch_dist", 1)
            self._params, self._source, self._order = params, source, order
            self._max, self._workers = max_chunk_bytes, workers or WorkerSpec()
            self._progress = progress
            self.written_bytes, self._share_bytes = 0, 0
            self._helpers: dict = {}
            self._dir = None

        @property
        def can_handle_sharded_objects(self):
            return True

        def save(self, sharded_state_dict, checkpoint_dir):
            spec, self._dir = self._workers, checkpoint_dir
            planner, writer, plan, metadata = self._plan(sharded_state_dict, checkpoint_dir)
            digest = _digest(plan.items)
            if spec.digest is not None and digest != spec.digest:
                raise RuntimeError(
                    f"worker {spec.index} planned {digest}, the process that started "
                    f"it {spec.digest}: different code or input"
                )
            shares = _shares(plan.items, lambda i: self._sort_key(planner.view(i)), spec.count)
            self._share_bytes = sum(_item_bytes(i) for i in shares[spec.index])
            threads = workers.threads_per_worker(spec) if spec.leads_node else None
            self._helpers = workers.start_local_helpers(checkpoint_dir, spec, digest, self._max, threads)
            own_threads = torch.get_num_threads()
            try:
                torch.set_num_threads(threads or own_threads)
                own = writer.write_items(shares[spec.index], planner)
                self._source.release()
                if spec.index > 0:  # hand the results to the coordinator once this node is done
                    workers.wait_local_helpers(checkpoint_dir, self._helpers)
                    workers.hand_back(checkpoint_dir, spec, digest, own)
                    return
                results = [own] + workers.collect_results(checkpoint_dir, spec, digest, self._helpers)
            finally:
                torch.set_num_threads(own_threads)
                workers.stop(self._helpers)
            self.written_bytes = sum(r.size_in_bytes for rs in results for r in rs)
            writer.finish(metadata, results)  # .metadata, written last

        def _plan(self, sharded_state_dict, checkpoint_dir):
            """megatron's translation to DCP and DCP's planning, with our chunks and views."""
            from megatron.core.dist_checkpointing.mapping import ShardedTensor
            from megatron.core.dist_checkpointing.strategies.torch import (
                _replace_state_dict_keys_with_sharded_keys,
                mcore_to_pyt_state_dict,
            )

            by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            views = {}
            for key, shards in by_key.items():
                for sh in shards:
                    if isinstance(sh, ShardedTensor):
                        if sh.flattened_range is not None:
                            raise RuntimeError(
                                f"{key}: flattened sharded tensors (optimizer "
                                "state) are not supported by the streaming converter"
                            )
                        views[(key, tuple(sh.global_offset))] = view_of(sh, self._params)
            pyt_state = mcore_to_pyt_state_dict(by_key, False)
            planner = _planner_class()(views, self._source, self._max)
            writer = _StreamingWriter(checkpoint_dir, self._workers.index, self._count)
            planner.set_up_planner(pyt_state, storage_meta=writer.storage_meta(), is_coordinator=True)
            writer.set_up_storage_writer(True)
            local = writer.prepare_local_plan(planner.create_local_plan())
            plans, metadata = planner.create_global_plan([local])
            for key, md in metadata.state_dict_metadata.items():  # DCP checks overlaps; we, the fill
                if (
                    getattr(md, "chunks", None)
                    and len(md.size)
                    and sum(c.sizes.numel() for c in md.chunks) != md.size.numel()
                ):
                    raise RuntimeError(f"{key}: chunks {md.chunks} do not tile shape {tuple(md.size)}")
            return planner, writer, planner.finish_plan(writer.prepare_global_plan(plans)[0]), metadata

        def _sort_key(self, view: View) -> tuple:
            return (self._order.get(view.param, -1), view.span()[0])

        def _count(self, nbytes: int) -> None:
            self.written_bytes += nbytes
            if self._progress is not None:
                self._progress(self.written_bytes, self._share_bytes)
            workers.check_helpers(self._dir, self._helpers)  # fail fast, not at the end

    return StreamingSaveStrategy


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------


def save_streaming(
    model,
    entries,
    reader,
    ctx: dict,
    out_dir,
    workers: WorkerSpec = None,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write `model`'s (meta) sharded state as megatron's torch_dist checkpoint; returns the bytes
    of tensor files written (all workers). `progress(done, total)` follows this process's share.

    Worker processes > 0 (WorkerSpec.index) write their share and skip common.pt/metadata.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    state = model.state_dict(keep_vars=True)
    completeness.check_produced(entries, state)
    tensors = {n: t for n, t in state.items() if isinstance(t, torch.Tensor)}
    shapes = {n: (t.shape, t.dtype) for n, t in tensors.items()}
    source = TensorSource(entries, reader, ctx, shapes)
    strategy = _strategy_class()(
        {id(t): n for n, t in tensors.items()},
        source,
        {n: i for i, n in enumerate(tensors)},
        max_chunk_bytes,
        workers,
        progress,
    )
    with MetaViewsStayViews():  # factories applied here, so their outputs are parameter views
        sharded = {"model": model.sharded_state_dict()}
        apply_factories(sharded)
    if workers is not None and workers.index > 0:
        sharded_part, _ = save_preprocess(sharded, validate_access_integrity=False)
        strategy.save(sharded_part, str(out_dir))
    else:
        dist_checkpointing.save(sharded, str(out_dir), sharded_strategy=strategy)
    source.release()
    return strategy.written_bytes
