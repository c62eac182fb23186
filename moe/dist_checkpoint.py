"""Sharded checkpoints of a Megatron-Core model and its distributed optimizer with `dist_checkpointing`.

One folder per saved state dict, written by `megatron.core.dist_checkpointing.save` with the `torch_dist`
backend (torch.distributed.checkpoint underneath), one file per rank (`thread_count=1`):

    __<rank>_0.distcp   the tensors this rank holds as main replica (a rank with nothing to save writes none)
    .metadata           global metadata: every key's global shape, dtype, chunks and the file holding each
                        chunk (a pickle written by torch.distributed.checkpoint; see "Safety" below)
    common.pt           the non-sharded part (torch.save by rank 0; read back with weights_only=True)
    metadata.json       {"sharded_backend": "torch_dist", "common_backend": "torch", ...}

Model: `model.sharded_state_dict()` (Megatron's own sharding metadata: global shapes, offsets over TP / EP /
PP, replica ids) minus the empty `_extra_state` objects of the local linear layers. Loading goes against
the *current* model's `sharded_state_dict()`, so a folder written at one layout (EP=2, PP=2) loads at
another (EP=1, PP=1): every rank reads just its slices from whichever files hold them. Megatron keys the
decoder layers by their global number, so pipeline stages (even or uneven splits) need nothing extra; with
tied embeddings at PP > 1 the last stage's copy is saved under the embedding's key as a non-main replica.

Optimizer (Megatron-Core's distributed optimizer, moe/optimizer.py): saved in its `fully_reshardable` form,
where each parameter's fp32 master copy and Adam moments are ShardedTensors of the parameter's own shape
and sharding under `optimizer.state.<kind>.<param key>`, so they reshard exactly like the weights (global
layer number, expert index and replica id included); the common part holds the param groups (hyper-
parameters and the Adam step). With bf16 parameters the fp32 master weights are what a resume continues
from, so a resumed run equals the uninterrupted one.

Saving is synchronous, and its file writing runs in the calling process. Megatron's torch_dist writer
(`FileSystemWriterAsync`) forks one writer process per file and collects results through a queue made by a
`spawn` multiprocessing Manager: a fork is refused inside daemonic processes (such as the gloo test
harness's ranks), and the Manager is a server process that re-imports the caller's `__main__` and outlives a
SIGKILLed trainer (measured: it and its resource tracker were left running). With one file per rank the
forked writer bought no parallelism, so `InProcessTorchDistSaveStrategy` calls the writer's own per-file
function (`FileSystemWriterAsync.write_preloaded_data`, fsync included) in this process, and
`_in_process_results_queue` swaps in a plain queue for the duration of the save. The Megatron symbols this
relies on are checked against their Megatron-Core 0.16.1 signatures (`verify_save_internals`), so an upgrade
that changes one fails loudly.

Safety: torch.distributed.checkpoint reads `.metadata` with plain `pickle.load`. Before any load, this
module unpickles that file with an allow-list of torch.distributed.checkpoint's metadata classes, torch
dtypes and `torch.Size` (`read_metadata_safely`) and refuses anything else, naming it; tensors are read by
torch with `weights_only=True`; `common.pt` is read with `weights_only=True`; pickled objects
(ShardedObjects, loaded by torch with weights_only=False) are never saved nor requested.

`moe` does not import `megagspo`; megagspo.checkpoint drives these functions.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import pickle
import queue
import warnings
from typing import Dict

import torch

from moe.cpu_shim import cuda_tensor_types
from moe.hf_checkpoint import all_finite
from moe.json_files import JsonFileError, read_json
from moe.sharding import full_names as sharding_full_names

SAVE_THREADS = 1  # files per rank
METADATA = ".metadata"
COMMON = "common.pt"
BACKEND_CONFIG = "metadata.json"


class DistCheckpointError(RuntimeError):
    """A sharded checkpoint folder is unreadable, unsafe, or does not fit the model; the message says which."""


# ------------------------------------------------------------------------------------ safe metadata read
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} (not a torch.distributed.checkpoint "
                                     "metadata type)")


def read_metadata_safely(directory: str):
    """The torch.distributed.checkpoint Metadata of a folder, unpickled with an allow-list of types."""
    path = os.path.join(directory, METADATA)
    try:
        with open(path, "rb") as f:
            data = f.read()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError,
            KeyError) as exc:
        raise DistCheckpointError(f"{path}: not a readable torch.distributed.checkpoint metadata file "
                                  f"({type(exc).__name__}: {exc})") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise DistCheckpointError(f"{path}: holds a {type(metadata).__name__}, not a Metadata")
    return metadata


def check_folder(directory: str) -> None:
    """Raise DistCheckpointError unless `directory` is a torch_dist folder whose metadata unpickles with the
    allow-list and whose every referenced shard file exists."""
    cfg_path = os.path.join(directory, BACKEND_CONFIG)
    try:
        backend = read_json(cfg_path).get("sharded_backend")
    except JsonFileError as exc:
        raise DistCheckpointError(f"unreadable: {exc}") from None
    if backend != "torch_dist":
        raise DistCheckpointError(f"{cfg_path}: sharded_backend {backend!r}, expected 'torch_dist'")
    metadata = read_metadata_safely(directory)
    for info in (metadata.storage_data or {}).values():
        rel = info.relative_path
        if os.path.isabs(rel) or ".." in rel.split("/") or not os.path.isfile(os.path.join(directory, rel)):
            raise DistCheckpointError(f"{os.path.join(directory, rel)}: shard file named by {METADATA} is missing")
    _check_tensor_layout(metadata, os.path.join(directory, METADATA))


def _check_tensor_layout(metadata, where: str) -> None:
    """Every tensor's chunks lie inside its shape, cover it once, and are each backed by at least as many
    stored bytes as they hold: a metadata file that claims a [10^7, 10^7] tensor (its checksum rewritten)
    is refused here instead of becoming a 400 TB allocation in the reader."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = {(index.fqn, tuple(index.offset)): info.length for index, info in (metadata.storage_data or {}).items()}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        shape, element = tuple(md.size), torch.empty((), dtype=md.properties.dtype).element_size()
        covered = 0
        for i, chunk in enumerate(md.chunks or []):
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or \
                    any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
                raise DistCheckpointError(f"{where}: chunk {i} of {key!r} (offsets {offsets}, sizes {sizes}) lies "
                                          f"outside the tensor's shape {shape}")
            volume = math.prod(sizes)
            if stored.get((key, offsets), -1) < volume * element:  # chunks are found by (key, offsets)
                raise DistCheckpointError(f"{where}: chunk {i} of {key!r} holds {volume} values, but "
                                          f"{stored.get((key, offsets), 0)} bytes are stored for it")
            covered += volume
        if covered != math.prod(shape):
            raise DistCheckpointError(f"{where}: the chunks of {key!r} hold {covered} values, its shape {shape} "
                                      f"{math.prod(shape)}")


def first_nonfinite_chunk(directory: str):
    """None when every floating-point chunk stored in the torch_dist folder `directory` is finite, else
    "<shard file>: <key> holds NaN or infinite values". A checkpoint that passes its checksums can still hold
    a NaN (written so, or re-checksummed by someone else), and a resume or export of it would train or ship
    nothing. Each chunk is checked with one `aminmax` (moe.hf_checkpoint.all_finite) over its stored bytes,
    memory-mapped in place (`_stored_values`: no copy); a chunk whose bytes are not laid out as
    torch.distributed.checkpoint writes them is read the way its loader reads it (`torch.load(weights_only=True)`
    of the chunk). Raises DistCheckpointError when the folder or a chunk cannot be read, OSError when a file
    vanishes."""
    import mmap

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    check_folder(directory)
    metadata = read_metadata_safely(directory)
    by_file: Dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        md = metadata.state_dict_metadata.get(index.fqn)
        if isinstance(md, TensorStorageMetadata) and md.properties.dtype.is_floating_point:
            by_file.setdefault(info.relative_path, []).append((index, info, md))
    for rel, items in sorted(by_file.items()):
        path = os.path.join(directory, rel)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            with (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else contextlib.nullcontext(b"")) as mm:
                for index, info, md in sorted(items, key=lambda item: item[1].offset):
                    key = index.fqn
                    if getattr(info, "transform_descriptors", None) or info.offset < 0 or info.length < 0 \
                            or info.offset + info.length > size:
                        raise DistCheckpointError(f"{path}: chunk of {key!r} lies outside the file or is stored "
                                                  "with transforms megagspo never writes")
                    values = _stored_values(mm, info.offset, info.length, md, index)
                    if values is None:  # not the usual layout: the loader's own reading
                        stored = io.BytesIO(mm[info.offset:info.offset + info.length])
                        try:
                            values = torch.load(stored, map_location="cpu", weights_only=True)
                        except Exception as exc:  # noqa: BLE001 - any unreadable chunk is the same error
                            raise DistCheckpointError(f"{path}: chunk of {key!r} is unreadable "
                                                      f"({type(exc).__name__})") from None
                        if not isinstance(values, torch.Tensor):
                            raise DistCheckpointError(f"{path}: chunk of {key!r} is not a tensor")
                    finite = all_finite(values)
                    del values  # a view of the map: gone before the map closes
                    if not finite:
                        return f"{rel}: {key} holds NaN or infinite values"
    return None


class _Window(io.RawIOBase):
    """The bytes [start, start + length) of a buffer as a seekable read-only file (zipfile reads through it)."""

    def __init__(self, buffer, start: int, length: int) -> None:
        self._buffer, self._start, self._length, self._pos = buffer, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: pos, 1: self._pos + pos, 2: self._length + pos}[whence])
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, out) -> int:
        n = max(0, min(len(out), self._length - self._pos))
        out[:n] = self._buffer[self._start + self._pos:self._start + self._pos + n]
        self._pos += n
        return n


def _stored_values(mm, offset: int, length: int, md, index):
    """The chunk's values as a flat tensor viewing `mm` in place, when its bytes are what
    torch.distributed.checkpoint writes for a tensor: a torch.save zip whose one storage record is stored
    uncompressed, little-endian, exactly as large as the chunk's shape in the metadata says. None otherwise."""
    import math
    import zipfile

    chunk = next((c for c in md.chunks or [] if tuple(c.offsets) == tuple(index.offset)), None)
    if chunk is None:
        return None
    element = torch.empty((), dtype=md.properties.dtype).element_size()
    want = math.prod(chunk.sizes) * element
    try:
        window = _Window(mm, offset, length)
        with zipfile.ZipFile(window) as archive:
            records = [i for i in archive.infolist() if i.filename.rsplit("/", 2)[-2:-1] == ["data"]]
            order = [i for i in archive.infolist() if i.filename.endswith("/byteorder")]
            if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or records[0].file_size != want:
                return None
            if order and archive.read(order[0]) != b"little":
                return None
            record = records[0]
        window.seek(record.header_offset)
        header = window.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            return None
        start = record.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
            int.from_bytes(header[28:30], "little")
    except (zipfile.BadZipFile, ValueError, OSError, KeyError, EOFError):
        return None
    if start < 0 or start + want > length:
        return None
    with warnings.catch_warnings():  # a read-only map: the tensor is only read
        warnings.simplefilter("ignore")
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=want, offset=offset + start) if want else \
            torch.empty(0, dtype=torch.uint8)
    return raw.view(md.properties.dtype)


# ------------------------------------------------------------------------------------------ save internals
# parameter names at Megatron-Core 0.16.1 (their annotations print object addresses, so names are compared)
_SAVE_SIGNATURES = {
    "_get_write_results_queue": (),
    "FileSystemWriterAsync.write_preloaded_data_multiproc":
        ("transform_list", "use_msc", "rank", "write_buckets", "global_results_queue"),
    "FileSystemWriterAsync.write_preloaded_data":
        ("transform_list", "local_proc_idx", "write_bucket", "results_queue", "count_queue", "use_fsync", "kwargs"),
}


def _filesystem_async():
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async

    return filesystem_async


def verify_save_internals() -> None:
    """The Megatron symbols the in-process save relies on must exist with their Megatron-Core 0.16.1
    signatures; raise DistCheckpointError naming the one that changed."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    module = _filesystem_async()
    for dotted, expected in _SAVE_SIGNATURES.items():
        obj = module
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
        found = None if obj is None else tuple(inspect.signature(obj).parameters)
        if found != expected:
            raise DistCheckpointError(
                f"megatron dist_checkpointing filesystem_async.{dotted} is missing or changed its parameters:\n"
                f"  expected {expected}\n  found    {found}\nreview moe/dist_checkpoint.py (written for "
                "Megatron-Core 0.16.1)")
    if not hasattr(TorchDistSaveShardedStrategy, "_get_save_and_finalize_callbacks"):
        raise DistCheckpointError("megatron TorchDistSaveShardedStrategy._get_save_and_finalize_callbacks no longer "
                                  "exists: review moe/dist_checkpoint.py (written for Megatron-Core 0.16.1)")


@contextlib.contextmanager
def _in_process_results_queue():
    module = _filesystem_async()
    original = module._get_write_results_queue
    results: queue.Queue = queue.Queue()
    module._get_write_results_queue = lambda: results
    try:
        yield
    finally:
        module._get_write_results_queue = original


def _write_buckets_in_process(transform_list, use_msc, rank, write_buckets, results_queue) -> None:
    """What FileSystemWriterAsync.write_preloaded_data_multiproc does, without forking: each bucket (one
    file) written and fsync'ed by write_preloaded_data, results (or the first exception) put on the queue."""
    writer = _filesystem_async().FileSystemWriterAsync
    results = {}
    extra = {"use_msc": use_msc} if use_msc else {}
    for i, bucket in enumerate(write_buckets):
        local: queue.Queue = queue.Queue()
        count: queue.Queue = queue.Queue()
        count.put(i)
        writer.write_preloaded_data(transform_list, i, bucket, local, count, True, **extra)
        idx, outcome = local.get_nowait()
        if isinstance(outcome, Exception):
            results_queue.put(outcome)
            return
        results[idx] = outcome
    results_queue.put(results)


def _in_process_strategy():
    import functools

    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """Megatron's torch_dist save strategy with the file writing done in the calling process."""

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
            fn = request.async_fn
            if fn is None:  # nothing to write on this rank
                return request
            multiproc = _filesystem_async().FileSystemWriterAsync.write_preloaded_data_multiproc
            if not (isinstance(fn, functools.partial) and fn.func is multiproc and len(fn.args) == 2):
                raise DistCheckpointError(f"megatron torch_dist save returned an unexpected write function {fn!r}: "
                                          "review moe/dist_checkpoint.py (written for Megatron-Core 0.16.1)")
            return request._replace(async_fn=functools.partial(_write_buckets_in_process, *fn.args))

    return InProcessTorchDistSaveStrategy("torch_dist", 1, thread_count=SAVE_THREADS)


def _rank() -> int:
    return torch.distributed.get_rank()


def save_errors() -> tuple:
    """What a failed save raises besides OSError / DistCheckpointError: torch's CheckpointException (a
    BaseException, re-raised on every rank when any rank's write failed, e.g. a full disk) and Megatron's
    CheckpointingException."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    return (CheckpointException, CheckpointingException)


def _save(sharded_state_dict: dict, directory: str) -> None:
    """Collective: every rank writes its shards of `sharded_state_dict` into `directory`."""
    from megatron.core import dist_checkpointing

    verify_save_internals()
    # Rank 0 creates the folder; its failure is shared, so no rank waits in a collective the others left.
    box = [None]
    if _rank() == 0:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            box[0] = f"{type(exc).__name__}: {exc}"
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0]:
        raise DistCheckpointError(f"cannot create {directory} on rank 0: {box[0]}")
    with _in_process_results_queue():
        dist_checkpointing.save(sharded_state_dict, directory, sharded_strategy=_in_process_strategy(),
                                validate_access_integrity=True)


class _WeightsOnlyCommonLoad:
    """Megatron's torch common-load strategy, reading common.pt with weights_only=True and refusing
    ShardedObjects (pickles that torch would load with weights_only=False)."""

    def __new__(cls):
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

        class WeightsOnlyCommonLoadStrategy(TorchCommonLoadStrategy):
            def load_common(self, checkpoint_dir):
                path = os.path.join(str(checkpoint_dir), COMMON)
                try:
                    return torch.load(path, map_location="cpu", weights_only=True)
                except Exception as exc:  # noqa: BLE001 - any failure to read it safely is the same error
                    raise DistCheckpointError(f"{path}: cannot be read as a weights-only torch file "
                                              f"({type(exc).__name__}: {exc})") from None

            def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
                raise DistCheckpointError(f"{checkpoint_dir}: megagspo never loads ShardedObjects (pickles)")

        return WeightsOnlyCommonLoadStrategy()


def _load(sharded_state_dict: dict, directory: str) -> dict:
    """Collective: the tensors of `sharded_state_dict` (this rank's slices) read from `directory`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from megatron.core.dist_checkpointing.validation import StrictHandling

    check_folder(directory)  # every rank: the pickle torch will read passes the allow-list first
    try:
        return dist_checkpointing.load(sharded_state_dict, directory, sharded_strategy=TorchDistLoadShardedStrategy(),
                                       common_strategy=_WeightsOnlyCommonLoad(), strict=StrictHandling.RAISE_ALL)
    except DistCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - Megatron / torch raise many types; the message is what matters
        raise DistCheckpointError(f"{directory}: sharded load failed ({type(exc).__name__}: {exc})") from None


# ------------------------------------------------------------------------------------------------ model
def _is_empty_extra_state(data) -> bool:
    if data is None:
        return True
    if isinstance(data, torch.Tensor):
        return data.numel() == 0
    if isinstance(data, io.BytesIO):
        return len(data.getbuffer()) == 0
    return False


def model_sharded_state_dict(model) -> dict:
    """`model.sharded_state_dict()` without the empty `_extra_state` ShardedObjects of the local linear
    layers (None: Megatron ignores them on load). A non-empty one (e.g. Transformer Engine FP8 scaling
    state) would be saved as a pickle, so it is an error naming the key."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def strip(d: dict) -> dict:
        out = {}
        for key, value in d.items():
            if isinstance(value, dict):
                out[key] = strip(value)
            elif isinstance(value, ShardedObject):
                if not _is_empty_extra_state(value.data):
                    raise DistCheckpointError(
                        f"{key}: a non-empty ShardedObject ({type(value.data).__name__}); megagspo checkpoints hold "
                        "tensors only (objects would be pickled)")
            else:
                out[key] = value
        return out

    return strip(model.sharded_state_dict())


def save_model(model, directory: str) -> None:
    """Collective: the model's shards into `directory` (one .distcp file per rank that owns any)."""
    _save(model_sharded_state_dict(model), directory)


@torch.no_grad()
def load_model(model, directory: str) -> None:
    """Collective: this rank's slices of every parameter, read from `directory` whatever layout wrote it."""
    loaded = _load(model_sharded_state_dict(model), directory)
    try:
        model.load_state_dict(loaded, strict=True)
    except (RuntimeError, KeyError) as exc:
        raise DistCheckpointError(f"{directory}: weights do not fit this model: {exc}") from None


def full_names(model) -> Dict[str, str]:
    """local parameter name -> its full-model (TP=EP=PP=1) name (experts by global index, layers by global
    number through Megatron's layer offset, a tied embedding's last-stage copy as the embedding), as
    moe.sharding names them."""
    return sharding_full_names(model)


def _first_sharded_tensor(value):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(value, ShardedTensorFactory):
        built = value.build()
        value = built[0] if isinstance(built, (list, tuple)) else next(iter(built.values()))
    if not isinstance(value, ShardedTensor):
        raise DistCheckpointError(f"{type(value).__name__} where a ShardedTensor was expected")
    return value


def model_index(model) -> Dict[str, dict]:
    """Collective. full parameter name -> {"key", "offset"}: the checkpoint key holding it and its index on
    that key's prepended axes (experts: the global expert index), so a single process can rebuild the full
    TP=EP=PP=1 state dict from the shards (`read_full_state_dict`). Identical on every rank."""
    sd = model_sharded_state_dict(model)
    names = full_names(model)
    local = {}
    for name, value in sd.items():
        if name not in names:
            continue
        sh = _first_sharded_tensor(value)
        local[names[name]] = {"key": sh.key, "offset": [int(o) for o in sh.global_offset[:sh.prepend_axis_num]]}
    missing = sorted(set(names) - set(sd))
    if missing:
        raise DistCheckpointError(f"parameters without a ShardedTensor in the model's sharded_state_dict: {missing[:4]}")
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    index: Dict[str, dict] = {}
    for part in gathered:
        index.update(part)
    return dict(sorted(index.items()))


def read_full_state_dict(directory: str, index: Dict[str, dict]) -> Dict[str, torch.Tensor]:
    """The full TP=EP=PP=1 state dict (full name -> tensor) from a model folder, in one process without any
    process group: each key's global tensor is read from all rank files, then split by `index`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    check_folder(directory)

    class AllowListReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata_safely(directory)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    metadata = read_metadata_safely(directory)
    targets: Dict[str, torch.Tensor] = {}
    for name, where in index.items():
        key = where["key"]
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise DistCheckpointError(f"{directory}: no tensor {key!r} (for {name}) in {METADATA}")
        if key not in targets:
            targets[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(targets, storage_reader=AllowListReader(directory), no_dist=True)
    except Exception as exc:  # noqa: BLE001
        raise DistCheckpointError(f"{directory}: reading shards failed ({type(exc).__name__}: {exc})") from None
    out = {}
    for name, where in index.items():
        t = targets[where["key"]]
        for o in where["offset"]:
            t = t[o]
        out[name] = t.clone()
    return out


# -------------------------------------------------------------------------------------------- optimizer
# Megatron-Core's distributed optimizer in its `fully_reshardable` form: every model parameter gets its fp32
# master copy (`param`) and Adam moments (`exp_avg`, `exp_avg_sq`) as ShardedTensors of the parameter's own
# shape and sharding (`optimizer.state.<kind>.<param key>`), so they reshard over TP / EP / PP / DP exactly like
# the weights. "Memory-efficient" exchange: each data-parallel group's shards are gathered over gloo into host
# memory of its DP rank 0, which writes them (no device memory is used, and the same code runs on CPU and GPU).
# The common part (torch.save, read back weights-only) holds the param groups, the Adam step among them.
DIST_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                         "distrib_optim_fully_reshardable_mem_efficient": True,
                         # tensor keys independent of how many sub-optimizers (dense, expert) a layout has
                         "chained_optim_avoid_prefix": True}
# param-group entries that are state or schedule, not hyper-parameters the run's config sets
_GROUP_STATE = ("params", "step", "lr", "initial_lr", "max_lr", "min_lr")


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def optimizer_has_state(optimizer) -> bool:
    """True once the optimizer has stepped (Adam moments exist)."""
    return any(len(sub.optimizer.state) for sub in _sub_optimizers(optimizer) if getattr(sub, "optimizer", None))


def _has_parameters(sub) -> bool:
    inner = getattr(sub, "optimizer", None)
    return inner is not None and any(len(group["params"]) for group in inner.param_groups)


def _sharded_optimizer_state(model, optimizer, is_loading: bool) -> dict:
    """{sub-optimizer index: its sharded state dict} for the sub-optimizers (dense, expert) that hold
    parameters on this rank. A pipeline stage without MoE layers has a parameter-less expert optimizer, whose
    state_dict() Megatron-Core 0.16.1 cannot build with torch's Adam (it asserts one step over an empty state):
    it is left out, and holds nothing to save or load."""
    out = {}
    with cuda_tensor_types():
        for index, sub in enumerate(_sub_optimizers(optimizer)):
            if not _has_parameters(sub):
                continue
            if is_loading and len(sub.optimizer.state) == 0:
                # Megatron-Core 0.16.1 builds the loading template from the optimizer's own state_dict(), which
                # with torch's AdamW (no TE / apex) asserts that every parameter has a step: a fresh optimizer
                # has none. Megatron's own remedy (used for its FSDP format) allocates the state with one
                # zero-gradient step; every value it writes (master weights, moments, step) is then replaced.
                if not hasattr(sub, "_init_optimizer_states_with_dummy_values"):
                    raise DistCheckpointError("Megatron's DistributedOptimizer has no "
                                              "_init_optimizer_states_with_dummy_values: review moe/dist_checkpoint.py")
                sub._init_optimizer_states_with_dummy_values()
            out[index] = sub.sharded_state_dict(model_sharded_state_dict(model), is_loading=is_loading,
                                                metadata=dict(DIST_OPTIMIZER_FORMAT))
    return out


def save_optimizer(model, optimizer, directory: str) -> None:
    """Collective: the distributed optimizer's master weights and moments (model-space ShardedTensors) and its
    param groups into `directory`."""
    if not optimizer_has_state(optimizer):
        raise DistCheckpointError("the optimizer has no state to save (no update yet)")
    try:
        sharded = _sharded_optimizer_state(model, optimizer, is_loading=False)
    except KeyError as exc:  # Megatron's exchange expects Adam's moments (e.g. plain SGD has none)
        raise DistCheckpointError(f"optimizer state has no {exc} (only Adam-family optimizers are checkpointed)") from None
    _save(sharded, directory)


def _hyper_parameters(optimizer) -> list:
    return [{k: v for k, v in group.items() if k not in _GROUP_STATE} for group in optimizer.param_groups]


@torch.no_grad()
def load_optimizer(model, optimizer, directory: str) -> list:
    """Collective: this rank's shards of the master weights and moments (whatever layout wrote them) and the
    steps, into `optimizer`, whose master weights are copied into the model's parameters. Hyper-parameters stay
    the live optimizer's (the run's config, which a resumed run may change on purpose, e.g. `--resume
    rl.optim.weight_decay=0.1`). -> ["key: saved -> now", ...] for each one that differs from the checkpoint's."""
    live = _hyper_parameters(optimizer)
    saved_groups = _saved_param_groups(directory)
    template = _sharded_optimizer_state(model, optimizer, is_loading=True)
    loaded = _load(template, directory)
    # the live optimizer's own non-tensor entries, hyper-parameters included, with the saved step
    state = _in_live_structure(template, loaded, _saved_step(saved_groups, directory))
    subs = _sub_optimizers(optimizer)
    try:
        for index, part in state.items():
            subs[index].load_state_dict(part)
    except (KeyError, ValueError, RuntimeError, AssertionError) as exc:
        raise DistCheckpointError(f"{directory}: optimizer state does not fit this optimizer "
                                  f"({type(exc).__name__}: {exc})") from None
    _untie_adam_steps(optimizer)
    for group, hyper in zip(optimizer.param_groups, live):
        group.update(hyper)
    changed = _changed_hyper_parameters(saved_groups, live)
    # the model's parameters take the loaded master weights (bf16 parameters: rounded from the fp32 masters)
    for sub in _sub_optimizers(optimizer):
        if hasattr(sub, "_copy_main_params_to_model_params"):
            sub._copy_main_params_to_model_params()
    return changed


def _saved_param_groups(directory: str) -> list:
    """Every param group (dicts of hyper-parameters and the step) in an optimizer checkpoint's common part,
    whatever sub-optimizer structure wrote it."""
    path = os.path.join(directory, COMMON)
    try:
        common = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read it safely is the same error
        raise DistCheckpointError(f"{path}: cannot be read as a weights-only torch file ({type(exc).__name__}: "
                                  f"{exc})") from None
    groups: list = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "param_groups" and isinstance(value, list):
                    groups.extend(g for g in value if isinstance(g, dict))
                else:
                    walk(value)

    walk(common)
    if not groups:
        raise DistCheckpointError(f"{path}: no optimizer param groups")
    return groups


def _saved_step(groups: list, directory: str) -> float:
    """The Adam step of an optimizer checkpoint (every param group of every sub-optimizer holds the same one)."""
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) != 1:
        raise DistCheckpointError(f"{os.path.join(directory, COMMON)}: expected one optimizer step in its param "
                                  f"groups, found {sorted(steps)}")
    return steps.pop()


# Param-group entries that choose torch's implementation of the same update, not a hyper-parameter: a run
# saved on the CPU (fused None) and resumed on a GPU (fused AdamW, moe.optimizer) has not changed its optimizer.
_IMPLEMENTATION_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def _changed_hyper_parameters(saved_groups: list, live: list) -> list:
    """["key: saved -> now", ...] for each hyper-parameter whose values over the param groups differ between
    the checkpoint and the live optimizer (compared as sets: the two may group the parameters differently).
    Implementation switches (`_IMPLEMENTATION_KEYS`) are not hyper-parameters and are never reported."""
    def values(groups, key):
        return {tuple(g[key]) if isinstance(g[key], (list, tuple)) else g[key] for g in groups if key in g}

    changed = []
    for key in sorted({k for g in live for k in g} - _IMPLEMENTATION_KEYS):
        was, now = values(saved_groups, key), values(live, key)
        if was and was != now:
            show = lambda vs: repr(next(iter(vs))) if len(vs) == 1 else repr(sorted(vs, key=repr))  # noqa: E731
            changed.append(f"{key}: {show(was)} in the checkpoint -> {show(now)} now")
    return changed


def _in_live_structure(template, loaded, step: float):
    """The state dict `optimizer.load_state_dict` wants, in THIS optimizer's structure: the loaded tensors
    where the template has ShardedTensors, the live optimizer's own non-tensor entries elsewhere, with the
    saved step in every param group. (The checkpoint's common part has the structure of the layout that wrote
    it: a dense and an expert sub-optimizer at EP > 1, one at EP = 1; its hyper-parameters are the config's
    business, see load_optimizer.)"""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    if isinstance(template, (ShardedBase, ShardedTensorFactory)):
        return loaded
    if isinstance(template, dict):
        out = {k: _in_live_structure(v, loaded.get(k) if isinstance(loaded, dict) else None, step)
               for k, v in template.items()}
        if isinstance(out.get("param_groups"), list):
            for group in out["param_groups"]:
                if isinstance(group, dict) and "step" in group:
                    group["step"] = step
        return out
    if isinstance(template, list):
        return [_in_live_structure(v, loaded[i] if isinstance(loaded, list) and i < len(loaded) else None, step)
                for i, v in enumerate(template)]
    return template


def _untie_adam_steps(optimizer) -> None:
    """Megatron-Core 0.16.1's DistributedOptimizer.load_state_dict (torch Adam, no TE / apex) gives every
    parameter's state the SAME `step` tensor; torch's Adam increments it in place once per parameter, so after
    one update the bias correction of every parameter is off (measured: the second update after a resume
    differs). Each parameter gets its own copy, as Megatron does on its TE / apex path."""
    for sub in _sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()


@torch.no_grad()
def local_optimizer_state(model, optimizer) -> Dict[str, Dict[str, torch.Tensor]]:
    """{local parameter name: {"param" (fp32 master), "exp_avg", "exp_avg_sq": tensors of the parameter's local
    shape}, "step": scalar} from the distributed optimizer's shards, gathered over each data-parallel group
    (gloo, host memory; collective over data parallelism). For checks and tests: checkpoints do not use it."""
    names = {p: n for n, p in model.named_parameters()}
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for sub in _sub_optimizers(optimizer):
        with cuda_tensor_types():
            world = sub.get_parameter_state_dp_zero(use_gloo_comm=True, return_on_all_ranks=True)
        # torch's Adam counts per parameter (a group's "step" is only what Megatron's load left there)
        step = next((float(st["step"]) for st in sub.optimizer.state.values() if "step" in st), 0.0)
        for gbuf_idx, buffer in enumerate(sub.buffers):
            for tensors in world[gbuf_idx].values():
                for param, (start, end, _) in buffer.param_index_map.items():
                    entry = {k: tensors[k][start:end].reshape(param.shape).clone()
                             for k in ("param", "exp_avg", "exp_avg_sq")}
                    entry["step"] = torch.tensor(float(step))
                    out[names[param]] = entry
    return out
