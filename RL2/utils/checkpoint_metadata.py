"""A checkpoint's `.metadata` read without running code from it: torch's `FileSystemReader` unpickles this index
of the shards with plain `pickle.load`, so a file planted there would run what it names at resume.
`SafeFileSystemReader` unpickles it with an allow-list of the classes such an index is made of; anything else is
refused before it is called. (The shards hold tensors and plain values, read with `weights_only=True`.)
"""

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from RL2.config.errors import ConfigError

METADATA = ".metadata"
# (module, name) a checkpoint index may name: what torch's own saves write, and nothing that runs code.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's index never holds")


def read_checkpoint_index(path: Path, file: Path | None = None) -> Metadata:
    """The shard index of checkpoint folder `path` (in `file`, by default its `.metadata`); a ConfigError when
    it names anything else, before anything it names is called."""
    file = Path(file) if file is not None else Path(path) / METADATA
    try:
        with open(file, "rb") as f:
            index = _IndexUnpickler(f).load()
    except FileNotFoundError:
        raise ConfigError(f"trainer.load_ckpt_from: {file} is missing, so {path} is not a complete checkpoint; "
                          f"resume from another step folder") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise ConfigError(f"trainer.load_ckpt_from: {file} is not a checkpoint index RL2 wrote ({e}), so it is "
                          f"not loaded: it was damaged, planted or written by other software. Resume from another "
                          f"step folder, or delete this one") from None
    if not isinstance(index, Metadata):
        raise ConfigError(f"trainer.load_ckpt_from: {file} holds a {type(index).__name__}, not a checkpoint index; "
                          f"resume from another step folder")
    return index


class SafeFileSystemReader(FileSystemReader):
    """torch's reader of checkpoint folder `path`, whose `index` the caller has read (`read_checkpoint_index`)."""

    def __init__(self, path: str, index: Metadata):
        super().__init__(path)
        self.index = index

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank, index = kwargs.get("rank"), self.index
        if rank is not None:  # a rank's own index, where torch asks for one: read the same way
            index = read_checkpoint_index(Path(self.path), Path(self._get_metadata_path(rank)))
        if getattr(index, "storage_meta", None) is None:
            index.storage_meta = StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index
