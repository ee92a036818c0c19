"""The `torch.distributed.checkpoint` (DCP) side: plans, planners, writer and reader.

[Note: DCP without its collectives] `dcp.save` coordinates ranks through
`torch.distributed` calls on a registered process group; the simulated mesh's gloo
groups are not registered, and we want one code path for both backends. So we run DCP's
own save protocol step by step, with our `agree` in place of its gather/scatter:

  1. every rank's `SavePlan` is built from the gathered manifests (any rank can build
     any rank's plan, so no plan travels): a `SHARD` item per non-empty block at its
     global offsets, a `TENSOR` item for whole tensors, a `BYTE_IO` item per Python value;
  2. `DefaultSavePlanner.create_global_plan` dedups the items several ranks hold
     (replicated leaves, HSDP replicas) and builds the `Metadata`, identically on every
     rank; `FileSystemWriter.prepare_global_plan` names each rank's file `__{rank}_0.distcp`;
  3. each rank writes its items with `FileSystemWriter.write_data`;
  4. the `WriteResult`s are gathered (`agree`) and rank 0 writes `.metadata` with
     `FileSystemWriter.finish`.

The directory is byte for byte what `dcp.save` writes, so `dcp.load`, FSDP2's
`set_model_state_dict` flow and `dcp_to_torch_save` read it. Loading is local to each
rank (DCP's default load needs no coordination either): the reads for this rank's
blocks come from DCP's resharding helper `create_read_items_for_chunk_list`.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ._layout import Entry, chunk_of, numel

__all__ = ["save_plan", "write_blocks", "finish", "read_metadata", "read_blocks"]


def save_plan(entries: Sequence[Entry], shapes: dict[str, tuple[int, ...]]) -> SavePlan:
    """One rank's DCP SavePlan, from its manifest. See [Note: DCP without its collectives]."""
    items = []
    for e in entries:
        if e.kind == "object":
            items.append(WriteItem(index=MetadataIndex(e.key), type=WriteItemType.BYTE_IO))
            continue
        chunk = _write_chunk(e, shapes[e.key])
        if chunk is None:
            continue
        offsets, sizes = chunk
        gshape = torch.Size(shapes[e.key])
        items.append(
            WriteItem(
                index=MetadataIndex(e.key, offsets),
                type=WriteItemType.TENSOR if sizes == gshape else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties(dtype=e.dtype),
                    size=gshape,
                ),
            )
        )
    return SavePlan(items)


def _write_chunk(e: Entry, gshape: tuple[int, ...]):
    """`(offsets, sizes)` this rank writes for a tensor leaf, or None.

    Empty blocks are not written (DCP needs no chunk for them); a tensor with no elements
    at all is written whole, once, by the ranks holding block 0 of every dim, so that its
    key and shape are in the metadata.
    """
    if numel(gshape) == 0:
        if any(index for index, _ in e.blocks):
            return None
        return torch.Size([0] * len(gshape)), torch.Size(gshape)
    offsets, sizes = chunk_of(e, gshape)
    if numel(sizes) == 0:
        return None
    return torch.Size(offsets), torch.Size(sizes)


class _SavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner over a flat `{key: block}` dict whose blocks sit at global offsets."""

    def __init__(self, blocks: dict[str, Any]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.state_dict = blocks
        self.is_coordinator = False

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[index.fqn]

    def resolve_data(self, write_item: WriteItem):
        value = self.lookup_object(write_item.index)
        if write_item.type == WriteItemType.BYTE_IO:
            return self.transform_object(write_item, value)
        sizes = write_item.tensor_data.chunk.sizes
        if value.numel() == 0 and value.shape != sizes:  # see _write_chunk: an empty tensor, whole
            return torch.empty(sizes, dtype=value.dtype)
        return value.detach()


class _Writer(FileSystemWriter):
    """FileSystemWriter that writes into a temporary directory but records the final path."""

    def __init__(self, tmp: str, final: str):
        super().__init__(tmp, sync_files=True, overwrite=True)
        self.final_path = final

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.final_path, save_id=self.save_id)


def write_blocks(tmp: str, final: str, rank: int, plans: list[SavePlan], blocks: dict[str, Any]):
    """Steps 2-3 of [Note: DCP without its collectives]: `(this rank's WriteResults, Metadata, writer)`."""
    planner = _SavePlanner(blocks)
    global_plans, metadata = planner.create_global_plan(plans)
    metadata.planner_data = {key: (key,) for key in metadata.state_dict_metadata}  # flat keys, as dcp.save
    writer = _Writer(tmp, final)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    writer.prepare_local_plan(plans[rank])  # creates the directory
    global_plans = writer.prepare_global_plan(global_plans)
    local = planner.finish_plan(global_plans[rank])
    future = writer.write_data(local, planner)
    future.wait()
    return future.value(), metadata, writer


def finish(writer: FileSystemWriter, metadata: Metadata, results: list) -> None:
    """Step 4: rank 0 writes `.metadata` (DCP writes it to a temp name, then renames)."""
    writer.finish(metadata=metadata, results=results)


def read_metadata(path: str) -> Metadata:
    return FileSystemReader(path).read_metadata()


class _LoadPlanner(DefaultLoadPlanner):
    """Reads this rank's blocks (at global offsets) and Python values into flat dicts."""

    def __init__(self, targets: dict[str, torch.Tensor], offsets: dict[str, tuple[int, ...]], objects: list[str]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.targets, self.offsets, self.object_keys = targets, offsets, objects
        self.objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, target in self.targets.items():
            if target.numel() == 0:
                continue
            chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets[key]), sizes=target.shape)
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        for key in self.object_keys:
            index = MetadataIndex(key)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                  storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.targets[index.fqn]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Python values are pickles (like dcp.load's, not weights_only): load trusted checkpoints only.
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


def read_blocks(path: str, metadata: Metadata, targets: dict[str, torch.Tensor],
                offsets: dict[str, tuple[int, ...]], objects: list[str]) -> dict[str, Any]:
    """Fill `targets` (this rank's blocks, in place) and return the Python values by key."""
    reader = FileSystemReader(path)
    reader.set_up_storage_reader(metadata, True)
    planner = _LoadPlanner(targets, offsets, objects)
    planner.set_up_planner({}, metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = planner.finish_plan(reader.prepare_global_plan([plan])[0])
    reader.read_data(plan, planner).wait()
    return planner.objects
