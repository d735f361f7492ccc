"""Moving the actor's weights to SGLang servers: in buckets, through a folder or through CUDA IPC.

- Disk: the buckets become the safetensors shards of a Hugging Face folder, written under a
  temporary name and renamed into place, which the servers read with `/update_weights_from_disk`.
  Works wherever the servers can read the trainer's files (CPU included).
- Tensor (CUDA only): each bucket is flattened into one tensor with SGLang's `FlattenedTensorBucket`
  and pickled with SGLang's `MultiprocessingSerializer`, which sends CUDA IPC handles, not the
  bytes; `/update_weights_from_tensor` maps them in the server (`load_format="flattened_bucket"`).
  This needs `sglang` importable in the trainer's environment.
"""

import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

# The parts of a Hugging Face folder besides the weights that describe the model.
CONFIG_FILES = ("config.json", "generation_config.json")


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
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
    """Write a Hugging Face folder, one safetensors shard per bucket, atomically.

    Args:
        tensor_buckets: lists of (parameter name, tensor), e.g. from `buckets`.
        folder: the folder to create; an existing one is replaced.
        config_from: a Hugging Face folder whose config files are copied (the served model's).

    Returns:
        `folder`. It appears complete or not at all: the files are written to `<folder>.tmp` first.
    """
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map, total_size, shards = {}, 0, []
    for index, bucket in enumerate(tensor_buckets):
        shard = f"model-{index + 1:05d}.safetensors"
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in bucket}
        save_file(tensors, partial / shard, metadata={"format": "pt"})
        shards.append(shard)
        for name, tensor in tensors.items():
            weight_map[name] = shard
            total_size += tensor.numel() * tensor.element_size()
    if not shards:
        raise ValueError("no tensors to write")
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    for name in CONFIG_FILES:
        if (Path(config_from) / name).is_file():
            shutil.copy(Path(config_from) / name, partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def serialize_cuda_bucket(bucket: list[tuple[str, torch.Tensor]]) -> str:
    """One bucket of CUDA tensors as `/update_weights_from_tensor` expects one tensor-parallel rank's
    entry of `serialized_named_tensors` with `load_format="flattened_bucket"`.

    The tensors must stay alive until the server has loaded them: the payload holds IPC handles.
    """
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat = FlattenedTensorBucket(named_tensors=bucket)
    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return MultiprocessingSerializer.serialize(payload, output_str=True)


def patch_cuda_ipc_for_sglang() -> None:
    """Make torch pickle CUDA tensors by device UUID, as SGLang's servers expect: a server sees other
    CUDA_VISIBLE_DEVICES than the trainer, so plain device indices would point at the wrong GPU."""
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
