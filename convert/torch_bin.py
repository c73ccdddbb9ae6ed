"""Read PyTorch ``pytorch_model*.bin`` checkpoints without torch.

A ``.bin`` written by ``torch.save`` (PyTorch >= 1.6) is a zip archive: ``data.pkl``
pickles the state dict, with each tensor's storage referenced by key and stored raw
(little-endian) in ``data/<key>``. The unpickler here admits only the handful of
names a state dict uses (tensor rebuild functions, storage types, ``OrderedDict``),
like ``torch.load(weights_only=True)``, so a checkpoint cannot run code.
"""

from __future__ import annotations

import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import numpy as np

_STORAGES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": np.float64,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _Storage:
    def __init__(self, kind, data: np.ndarray):
        self.kind, self.data = kind, data


def _rebuild_tensor(storage: _Storage, offset, size, stride, *args):
    a = storage.data
    if not size:
        return a[offset : offset + 1].reshape(())
    item = a.itemsize
    return np.lib.stride_tricks.as_strided(
        a[offset:], shape=tuple(size), strides=tuple(s * item for s in stride)
    ).copy()


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *args):
    return data


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, archive: zipfile.ZipFile, prefix: str, where: Path):
        super().__init__(f)
        self.archive, self.prefix, self.where = archive, prefix, where
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module, name):
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "torch" and name in _STORAGES:
            return name
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise ValueError(
            f"{self.where}: unexpected object {module}.{name} in the checkpoint "
            "(only tensors are read; re-save it as safetensors)"
        )

    def persistent_load(self, pid):
        # ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise ValueError(f"{self.where}: unexpected persistent id {pid!r}")
        kind, key = pid[1], str(pid[2])
        if key not in self.storages:
            dtype = _STORAGES.get(kind if isinstance(kind, str) else getattr(kind, "__name__", ""))
            if dtype is None:
                raise ValueError(f"{self.where}: unsupported storage type {kind!r}")
            raw = self.archive.read(f"{self.prefix}/data/{key}")
            data = np.frombuffer(raw, dtype=np.uint16 if dtype == "bfloat16" else dtype)
            self.storages[key] = _Storage(dtype, data)
        return self.storages[key]


def load_torch_bin(path: str | Path) -> dict[str, mx.array]:
    """The tensors of a ``torch.save`` zip checkpoint as MLX arrays (bfloat16 kept).

    Args:
        path: a ``pytorch_model*.bin`` file.

    Returns:
        ``{name: array}`` in the checkpoint's dtypes.

    Raises:
        ValueError: not a zip checkpoint (e.g. truncated, or the pre-1.6 format), or it
            holds anything but tensors; the message names the file.
    """
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
        names = archive.namelist()
        pkl = next(n for n in names if n.endswith("data.pkl"))
    except (zipfile.BadZipFile, StopIteration, OSError) as e:
        raise ValueError(
            f"{path}: not a readable PyTorch zip checkpoint ({e or 'no data.pkl'}); "
            "re-download it or convert it to safetensors"
        ) from e
    prefix = pkl[: -len("/data.pkl")]
    with archive:
        try:
            up = _Unpickler(archive.open(pkl), archive, prefix, path)
            state = up.load()
        except (pickle.UnpicklingError, EOFError, KeyError, zipfile.BadZipFile) as e:
            raise ValueError(f"{path}: corrupt PyTorch checkpoint ({e})") from e
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict, found {type(state).__name__}")
    out = {}
    for k, v in state.items():
        if not isinstance(v, np.ndarray):
            continue
        a = mx.array(v)
        if v.dtype == np.uint16:  # only bfloat16 storages are read as uint16
            a = a.view(mx.bfloat16)
        out[k] = a
    return out
