"""The ONNX export's bytes: an external-data file written tensor by tensor (`DataFile`), and the
checkpoint's weights read one tensor at a time (`Weights`): no step holds the whole model twice."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from export import ExportError
from export.onnx.onnx_graph import Initializer
from training.checkpoint.checkpoint_format import is_sharded
from training.checkpoint.checkpoint_io import ShardedReader

# model.onnx's weights are model.onnx_data: the name optimum writes and transformers.js requests (it fetches
# `<file>.onnx_data` by that name and hands it to ONNX Runtime under it, so the name the graph records must
# be the same). Exports written before used model.onnx.data: ONNX Runtime reads either (it follows the name
# recorded inside the .onnx file), and `external_data_files` finds a model's data files the same way.
EXTERNAL_DATA_SUFFIX = "_data"
LEGACY_DATA_SUFFIX = ".data"
# Large tensors start at a page boundary of the data file so ONNX Runtime can memory-map them
# (onnx's own external-data writer uses the same rule).
ALIGN_THRESHOLD, PAGE, SMALL_ALIGN = 1 << 20, 4096, 64


class OnnxExportError(ExportError):
    pass


def data_file(model_file: str) -> str:
    return model_file + EXTERNAL_DATA_SUFFIX


def external_data_files(model_path: Path) -> list[Path]:
    """The files beside `model_path` its initializers are kept in: the external-data locations recorded in
    the .onnx file (its graph is read, not its weights)."""
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    names = {e.value for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
             for e in t.external_data if e.key == "location"}
    return [model_path.parent / n for n in sorted(names)]


class DataFile:
    """An external-data file being appended to: each tensor at an aligned offset, referenced by an
    EXTERNAL TensorProto (location = the file's name, so the folder can be moved as a whole)."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.offset = 0

    def add_bytes(self, name: str, data_type: int, dims, raw) -> object:
        import onnx

        raw = memoryview(raw).cast("B")
        a = PAGE if raw.nbytes >= ALIGN_THRESHOLD else SMALL_ALIGN
        start = (self.offset + a - 1) // a * a
        self._f.write(b"\0" * (start - self.offset))
        self._f.write(raw)
        self.offset = start + raw.nbytes
        tp = onnx.TensorProto(name=name, data_type=data_type, dims=list(dims), data_location=onnx.TensorProto.EXTERNAL)
        for k, v in (("location", self.path.name), ("offset", str(start)), ("length", str(raw.nbytes))):
            e = tp.external_data.add()
            e.key, e.value = k, v
        return tp

    def add_array(self, name: str, arr: np.ndarray):
        from onnx.helper import np_dtype_to_tensor_dtype

        arr = np.ascontiguousarray(arr)
        return self.add_bytes(name, np_dtype_to_tensor_dtype(arr.dtype), arr.shape, arr)

    def add_proto(self, tp):
        """A TensorProto made by onnxruntime's quantizer (bytes in raw_data) moved to this file."""
        from onnx import numpy_helper

        raw = tp.raw_data if tp.HasField("raw_data") else np.ascontiguousarray(numpy_helper.to_array(tp)).tobytes()
        return self.add_bytes(tp.name, tp.data_type, tp.dims, raw)

    def close(self) -> None:
        self._f.close()


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class Weights:
    """The checkpoint's tensors, read one at a time as fp32 numpy in ONNX layout. Read with plain
    reads, not safetensors' memory map: a map kept open would leave every page it ever touched in
    the process's RSS (the whole model by the end), on top of the ONNX Runtime session that checks
    the export."""

    def __init__(self, weights_file: Path):
        self.file = Path(weights_file)
        self._sharded: ShardedReader | None = None
        if not self.file.is_file() and is_sharded(self.file.parent):
            # an FSDP2 checkpoint saved by every rank: each tensor's rows assembled on request (the
            # shards are memory-mapped; one tensor is assembled at a time)
            self._sharded = ShardedReader(self.file.parent, "model")
            self._index = dict.fromkeys(self._sharded.keys())
            return
        with open(self.file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        self._base = 8 + n
        self._index = {k: v for k, v in header.items() if k != "__metadata__"}

    def tensor(self, name: str) -> torch.Tensor:
        if self._sharded is not None:
            t = self._sharded.get_tensor(name)
            if t.dtype not in SAFETENSORS_DTYPES.values():
                raise OnnxExportError(f"{self._sharded.index_file}: no fp32/fp16/bf16 tensor {name}")
            return t.float()
        e = self._index.get(name)
        if e is None or e["dtype"] not in SAFETENSORS_DTYPES:
            raise OnnxExportError(f"{self.file}: no fp32/fp16/bf16 tensor {name}")
        start, end = e["data_offsets"]
        buf = bytearray(end - start)
        with open(self.file, "rb") as f:
            f.seek(self._base + start)
            if f.readinto(buf) != len(buf):
                raise OnnxExportError(f"{self.file}: truncated (tensor {name} is cut off)")
        return torch.frombuffer(buf, dtype=SAFETENSORS_DTYPES[e["dtype"]]).reshape(e["shape"]).float()

    def names(self) -> list[str]:
        return list(self._index)

    def get(self, item: Initializer) -> np.ndarray:
        arr = self.tensor(item.checkpoint_name).numpy()
        arr = np.ascontiguousarray(arr.T if item.transpose else arr, dtype="<f4")
        if tuple(arr.shape) != item.shape:
            raise OnnxExportError(f"{item.checkpoint_name}: shape {tuple(arr.shape)} in the checkpoint, "
                                  f"{item.shape} in the graph")
        return arr
