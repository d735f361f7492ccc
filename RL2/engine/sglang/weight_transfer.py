"""The actor's weights to SGLang servers in buckets (docs/gpus.md, "SGLang servers"): as a Hugging Face folder's shards
or as flat tensors in the payload format of SGLang's `FlattenedTensorBucket` and `MultiprocessingSerializer`, written
here so that the trainer needs no `sglang` (which pins its own torch)."""

import base64
import io
import json
import pickle
import shutil
from collections.abc import Iterable, Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch.multiprocessing import reductions

from RL2.utils.checkpoint import atomic_dir

# SGLang versions whose `/update_weights_from_tensor` reads the payload of `serialize_flat_bucket`: its
# `SafeUnpickler` admits a dict, `types.SimpleNamespace` metadata (read by attribute), torch dtypes
# and sizes, and `torch.multiprocessing.reductions.rebuild_cuda_tensor` (which the server patches to
# take a device UUID); and tensor updates run between `/begin_weight_update` and `/end_weight_update`.
FLATTENED_BUCKET_VERSIONS = ("0.5.23",)
# Byte alignment of each tensor in a flat bucket (a multiple of every dtype's size).
FLAT_ALIGNMENT = 16
# Position of the device index among the arguments `reduce_tensor` gives `rebuild_cuda_tensor`.
_CUDA_DEVICE_ARG = 6

# The parts of a Hugging Face folder besides the weights that describe the model.
CONFIG_FILES = ("config.json", "generation_config.json")


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
            bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group consecutive (name, tensor) pairs into lists of at most `bucket_bytes` (a larger tensor
    goes alone), so that no more than one bucket of full tensors is held at a time."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def write_hf_folder(tensor_buckets: Iterable[list[tuple[str, torch.Tensor]]], folder: str | Path,
                    config_from: str | Path) -> Path:
    """Write `folder` (replacing it, complete or not at all) as a Hugging Face folder, one safetensors shard per bucket
    of `tensor_buckets` (in the checkpoint's layout), with the config files of `config_from`."""
    with atomic_dir(folder) as partial:
        weight_map, total_size = {}, 0
        for index, bucket in enumerate(tensor_buckets):
            shard = f"model-{index + 1:05d}.safetensors"
            tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in bucket}
            save_file(tensors, partial / shard, metadata={"format": "pt"})
            for name, tensor in tensors.items():
                weight_map[name] = shard
                total_size += tensor.numel() * tensor.element_size()
        if not weight_map:
            raise ValueError("no tensors to write")
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        for name in CONFIG_FILES:
            if (Path(config_from) / name).is_file():
                shutil.copy(Path(config_from) / name, partial / name)
    return Path(folder)


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """One bucket as one uint8 tensor plus what rebuilds each named tensor from it, as SGLang's `FlattenedTensorBucket`
    reads it: tensors in bucket order, each at a byte offset aligned to `FLAT_ALIGNMENT` (mixed dtypes view right)."""
    parts, metadata, offset = [], [], 0
    for name, tensor in bucket:
        part = tensor.detach().contiguous().view(-1).view(torch.uint8)
        gap = -offset % FLAT_ALIGNMENT  # the server views each slice as its dtype: start at an aligned byte
        if gap:
            parts.append(part.new_zeros(gap))
            offset += gap
        metadata.append(SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                        end_idx=offset + part.numel(), numel=part.numel()))
        parts.append(part)
        offset += part.numel()
    return torch.cat(parts), metadata


def serialize_flat_bucket(flat: torch.Tensor, metadata: list[SimpleNamespace]) -> str:
    """One tensor-parallel rank's entry of `serialized_named_tensors` (base64 text) for `/update_weights_from_tensor`
    with `load_format="flattened_bucket"`: a CUDA `flat` as a CUDA IPC handle naming its GPU by UUID (a server sees
    other CUDA_VISIBLE_DEVICES than the trainer), to keep alive until the server has answered; a CPU one by value."""
    buffer = io.BytesIO()
    payload = {"flattened_tensor": flat, "metadata": metadata}
    if flat.is_cuda:
        pickler = ForkingPickler(buffer)
        pickler.dispatch_table[torch.Tensor] = _reduce_cuda_tensor_by_uuid
    else:
        pickler = pickle.Pickler(buffer)
    pickler.dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _reduce_cuda_tensor_by_uuid(tensor: torch.Tensor):
    """torch's CUDA IPC reduction with the device index replaced by the GPU's UUID (what SGLang's
    servers expect since they patch `rebuild_cuda_tensor` to look the UUID up)."""
    rebuild, args = reductions.reduce_tensor(tensor)
    device = args[_CUDA_DEVICE_ARG]
    if rebuild is not reductions.rebuild_cuda_tensor or not isinstance(device, int):
        raise RuntimeError("this torch's CUDA IPC reduction changed its layout; use rollout.weight_sync=disk")
    args = (*args[:_CUDA_DEVICE_ARG], str(torch.cuda.get_device_properties(device).uuid), *args[_CUDA_DEVICE_ARG + 1:])
    return rebuild, args
