"""Reading torch.distributed.checkpoint (DCP) folders without unpickling arbitrary objects: DCP reads its
`.metadata` pickle with a plain `pickle.load`, so a checkpoint from an untrusted source could run code. Only DCP's
metadata classes are admitted, and a payload of pickled (non-tensor) objects is refused: this package writes
tensor-only payloads (the optimizer's hyper-parameters go to JSON), so it never needs more.
"""

import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata


class DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata file, refusing any class that is not part of DCP's metadata."""

    ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module, name):
        if module in self.ALLOWED_MODULES or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from a checkpoint's metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, with the .metadata pickle read by DcpMetadataUnpickler."""

    def read_metadata(self, *args, **kwargs):  # noqa: ARG002 - DCP's signature; this package writes one .metadata
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = DcpMetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        pickled = [key for key, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
        if pickled:
            raise pickle.UnpicklingError(f"checkpoint holds pickled objects ({pickled[:3]}...); refusing to load")
        return metadata
