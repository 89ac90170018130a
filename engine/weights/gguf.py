"""Reading GGUF checkpoints (llama.cpp's single-file format): metadata, tensor table,
and the tensors themselves, memory-mapped and dequantized one tensor at a time.

`LLM("model.gguf")`: the file's metadata becomes a Hugging Face style config
(`gguf_names.hf_config`), its tensors are served under Hugging Face names
(`load_gguf_state_dict`) so the architecture modules and the loader's shape checks work
unchanged, and its vocabulary becomes the tokenizer (`gguf_tokenizer.py`).

The header (metadata and tensor table) is parsed here with `struct` over the memory
map: it names the tensor, the type and the byte range whenever something is wrong, and
it reads a 262k-token vocabulary in a fraction of the time `gguf.GGUFReader` takes. The
`gguf` package (the format's own library) supplies the type table and every
dequantizer. A split set (`name-00001-of-00003.gguf`) is read from its first file.
"""
from __future__ import annotations

import functools
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models import get_architecture
from fusegen.engine.weights.compressed import CompressedSource
from fusegen.engine.weights.gguf_names import gguf_tensor_names, hf_config, value_transform
from fusegen.engine.weights.lazy import LazyTensor

if TYPE_CHECKING:
    from fusegen.engine.models.config import ModelConfig

Q = GGMLQuantizationType
# The weight types fusegen reads: every one of them dequantizes through `gguf.quants`.
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K,
                   Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Float types read as torch views of the file: no numpy round trip, no copy.
_TORCH_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 (32-bit counts) predates every file in circulation
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# Metadata scalar types (gguf.GGUFValueType ids) -> struct format; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SPLIT = re.compile(r"(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf")


def gguf_model_config(path) -> ModelConfig:
    """The model's config from the file's metadata, as `ModelConfig.from_dir` reads a
    config.json."""
    from fusegen.engine.models.config import ModelConfig

    reader = GGUFFile.open(path)
    return ModelConfig.from_dict(hf_config(reader.metadata, reader.tensors, str(path)),
                                 source=str(path))


def load_gguf_state_dict(path, cfg: ModelConfig, dtype: torch.dtype,
                         keep_blocks: bool = False) -> dict[str, torch.Tensor]:
    """Every weight under its Hugging Face name as a `LazyTensor` in `dtype`, checked
    name by name and shape by shape against the config; nothing is read or dequantized
    until the loader uses a tensor, so layers load (or stream) one at a time.
    `keep_blocks` (the blocks kept: quantization="gguf", or None on a CPU): each 2-D
    block-quantized tensor whose value transform only reorders rows also carries
    `.compressed`, a `CompressedSource` of its raw blocks in Hugging Face row order
    (weights/quantized.py picks which to keep)."""
    reader, state = GGUFFile.open(path), _checked_tensors(path, cfg)
    arch = reader.require("general.architecture")
    out = {}
    for hf_name, info in state.items():
        transform = value_transform(arch, info.name, cfg.num_heads, cfg.num_kv_heads)
        out[hf_name] = LazyTensor(info.shape, dtype,
                                  functools.partial(reader.read, info, dtype, transform))
        if keep_blocks and len(info.shape) == 2 and info.qtype not in _TORCH_TYPES:
            out[hf_name].compressed = reader.block_source(info, transform)
    return out


def _checked_tensors(path, cfg: ModelConfig) -> dict[str, TensorInfo]:
    """Every weight's tensor-table entry under its Hugging Face name, checked name by
    name, shape by shape and type by type."""
    reader = GGUFFile.open(path)
    arch = reader.require("general.architecture")
    expected = get_architecture(cfg.architecture).checkpoint_shapes(cfg)
    names = gguf_tensor_names(arch, expected, cfg.num_layers, str(path))
    missing = [f"{hf} ({names[hf]})" for hf in expected if names[hf] not in reader.tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{path}: tensors missing for {', '.join(missing[:3])}{more}")
    unused = sorted(set(reader.tensors) - set(names.values()))
    if unused:
        raise ModelLoadError(f"{path}: tensor {unused[0]!r} has no place in a "
                             f"{cfg.architecture} with this metadata{_unused_hint(unused[0])}")
    state = {}
    for hf_name, shape in expected.items():
        info = reader.tensors[names[hf_name]]
        if info.shape != shape:
            raise ModelLoadError(f"{path}: tensor {info.name!r} has shape {info.shape}, but "
                                 f"the metadata implies {shape} for {hf_name!r}")
        reader.check_type(info)
        state[hf_name] = info
    return state


def _row_order(transform, num_rows: int) -> torch.Tensor | None:
    """The row order `transform` (numpy [rows, ...] -> same shape) applies, found by
    running it on row numbers, or None when it does anything but move whole rows:
    Llama's q/k un-permutation is a row order; restoring Gemma's `1 + w` norms changes
    values (of 1-D norms, which stay dense anyway)."""
    numbers = np.repeat(np.arange(num_rows, dtype=np.float32)[:, None], 2, axis=1)
    moved = transform(numbers.copy())
    if moved.shape != numbers.shape or not np.array_equal(moved[:, 0], moved[:, 1]):
        return None
    order = moved[:, 0]
    if not np.array_equal(np.sort(order), numbers[:, 0]):
        return None
    return torch.from_numpy(order.astype(np.int64))


def _unused_hint(name: str) -> str:
    if name == "rope_freqs.weight":  # llama.cpp's baked Llama 3 rope scaling
        return ("; it holds llama.cpp's precomputed rope scaling (Llama 3.1 and later), "
                "which fusegen reads only from a Hugging Face checkpoint's config.json")
    return ""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: the file lists dimensions fastest first
    qtype: GGMLQuantizationType
    offset: int  # byte offset in its file's memory map
    nbytes: int
    shard: int  # index into GGUFFile.maps


class GGUFFile:
    """A GGUF file (or split set) opened read-only: `metadata` (key -> value), `tensors`
    (name -> TensorInfo) and the memory maps the tensor data is read from."""

    def __init__(self, path: Path, metadata: dict, tensors: dict[str, TensorInfo],
                 maps: list[mmap.mmap]):
        self.path, self.metadata, self.tensors, self.maps = path, metadata, tensors, maps

    @classmethod
    def open(cls, path) -> "GGUFFile":
        """The file, parsed once per process while its files are unchanged: the engine
        reads its config, its tokenizer and its weights in turn."""
        paths = tuple(_split_paths(Path(path)))
        try:
            stamps = tuple((p.stat().st_size, p.stat().st_mtime_ns) for p in paths)
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read the GGUF file ({exc})") from None
        return cls._parse(paths, stamps)

    @classmethod
    @functools.lru_cache(maxsize=2)
    def _parse(cls, paths: tuple[Path, ...], stamps: tuple) -> "GGUFFile":
        metadata: dict = {}
        tensors: dict[str, TensorInfo] = {}
        maps = []
        for shard, part in enumerate(paths):
            mapped = _map(part)
            meta, infos = _parse_header(mapped, part, shard)
            if shard == 0:
                metadata = meta
            tensors |= {info.name: info for info in infos}
            maps.append(mapped)
        if len(paths) > 1 and metadata.get("split.count", len(paths)) != len(paths):
            raise ModelLoadError(f"{paths[0]}: its metadata says split.count "
                                 f"{metadata['split.count']}, its name {len(paths)} files")
        return cls(paths[0], metadata, tensors, maps)

    def require(self, key: str):
        """A metadata value that must be there; ModelLoadError naming the key if not."""
        if key not in self.metadata:
            raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing; the "
                                 "file was not written by a complete llama.cpp converter")
        return self.metadata[key]

    def read(self, info: TensorInfo, dtype: torch.dtype, transform=None) -> torch.Tensor:
        """One tensor in `dtype`, dequantized from the map. `transform` (numpy float32 ->
        float32) runs before the cast, on the values as the file holds them."""
        mapped = self.maps[info.shard]
        if info.qtype in _TORCH_TYPES and transform is None:
            count = info.nbytes // _TORCH_TYPES[info.qtype].itemsize
            flat = torch.frombuffer(mapped, dtype=_TORCH_TYPES[info.qtype], count=count,
                                    offset=info.offset)
            return flat.view(info.shape).to(dtype)  # no copy when the dtype matches
        block, block_bytes = GGML_QUANT_SIZES[info.qtype]
        raw = np.frombuffer(mapped, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        raw = raw.reshape(*info.shape[:-1], info.shape[-1] // block * block_bytes)
        values = dequantize(raw, info.qtype)  # float32 [*shape]
        if transform is not None:
            values = transform(values)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)

    def block_source(self, info: TensorInfo, transform=None):
        """`info`'s raw blocks as a `CompressedSource` (weights/compressed.py), or None
        where `transform` changes values rather than moving whole rows (its blocks would
        not hold the Hugging Face weight)."""
        order = None
        if transform is not None:
            order = _row_order(transform, info.shape[0])
            if order is None:
                return None
        read = functools.partial(_as_components, functools.partial(self.blocks, info, order))
        return CompressedSource("gguf", (int(info.qtype),), info.shape, info.nbytes,
                                info.name, read)

    def blocks(self, info: TensorInfo, order: torch.Tensor | None = None) -> torch.Tensor:
        """A 2-D tensor's blocks as stored: uint8 [out, row_bytes], a view of the memory
        map (the file lists the input dimension fastest, so each torch row is one
        contiguous run of whole blocks); `order`: the rows taken in that order (a copy)."""
        out = info.shape[0]
        flat = torch.frombuffer(self.maps[info.shard], dtype=torch.uint8, count=info.nbytes,
                                offset=info.offset)
        rows = flat.view(out, info.nbytes // out)
        return rows if order is None else rows[order]

    def check_type(self, info: TensorInfo) -> None:
        if info.qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor {info.name!r} has type {info.qtype.name}, which fusegen "
                f"cannot dequantize; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}. "
                "Convert the file with llama.cpp's llama-quantize to one of these")


def _as_components(blocks) -> dict[str, torch.Tensor]:
    return {"blocks": blocks()}


def _split_paths(path: Path) -> list[Path]:
    """The files of `path`'s split set, in order (just `path` when it is not split)."""
    match = _SPLIT.fullmatch(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if int(match["index"]) != 1:
        first = f"{match['stem']}-00001-of-{match['count']}.gguf"
        raise ModelLoadError(f"{path}: part {int(match['index'])} of a split GGUF set; pass "
                             f"its first file, {path.with_name(first)}")
    paths = [path.with_name(f"{match['stem']}-{i:05d}-of-{match['count']}.gguf")
             for i in range(1, count + 1)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{path}: the split set's files {', '.join(missing)} are "
                             "missing; download every part into the same folder")
    return paths


def _map(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            # A private (copy-on-write) mapping: writable for torch, never written.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:  # ValueError: an empty file
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({exc})") from None


class _Cursor:
    """Reads the header's little-endian fields in order; running off the end of the
    file means the file is truncated."""

    def __init__(self, mapped: mmap.mmap, path: Path):
        self.buf, self.path, self.pos = mapped, path, 0

    def unpack(self, fmt: str):
        try:
            values = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise self.truncated() from None
        self.pos += struct.calcsize(fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.pos + length > len(self.buf):
            raise self.truncated()
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path}: a metadata string at byte {self.pos - length} "
                                 f"is not UTF-8 ({exc.reason}); the file is damaged") from None

    def value(self, kind: int, key: str):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ModelLoadError(f"{self.path}: metadata key {key!r} has value type {kind}, "
                                 "which is not a GGUF type; the file is damaged")
        item, count = self.unpack("<IQ")
        if item in _SCALARS:  # numbers in one read: scores and token types are 262k long
            dtype = np.dtype(_SCALARS[item])
            if self.pos + count * dtype.itemsize > len(self.buf):
                raise self.truncated()
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return values.tolist()
        return [self.value(item, key) for _ in range(count)]

    def truncated(self) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: truncated: the GGUF header runs past the end of "
                              f"the file ({len(self.buf)} bytes); download it again")


def _parse_header(mapped: mmap.mmap, path: Path, shard: int) -> tuple[dict, list[TensorInfo]]:
    """One file's metadata and tensor table, each tensor's byte range checked against
    the file's size."""
    if mapped[:4] != _MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {mapped[:4]!r}, a GGUF "
                             f"file with {_MAGIC!r}); pass a .gguf file or a checkpoint folder")
    cur = _Cursor(mapped, path)
    cur.pos = 4
    version, num_tensors, num_keys = cur.unpack("<IQQ")
    if version not in _VERSIONS:
        raise ModelLoadError(f"{path}: GGUF version {version}; fusegen reads versions "
                             f"{' and '.join(map(str, _VERSIONS))}")
    metadata = {}
    for _ in range(num_keys):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"), key)
    table = [_tensor_entry(cur) for _ in range(num_tensors)]
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: general.alignment is {alignment}, not a power of two; "
                             "the file is damaged")
    data_start = -(-cur.pos // alignment) * alignment
    infos = [_tensor_info(path, shard, data_start, *entry) for entry in table]
    for info in infos:
        if info.offset + info.nbytes > len(mapped):
            raise ModelLoadError(
                f"{path}: truncated: tensor {info.name!r} ends at byte "
                f"{info.offset + info.nbytes}, past the end of the file ({len(mapped)} "
                "bytes); download it again")
    return metadata, infos


def _tensor_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    num_dims = cur.unpack("<I")
    if num_dims > _MAX_DIMS:
        raise ModelLoadError(f"{cur.path}: tensor {name!r} has {num_dims} dimensions (GGUF "
                             f"allows {_MAX_DIMS}); the file is damaged")
    dims = cur.unpack(f"<{num_dims}Q") if num_dims else ()
    dims = (dims,) if isinstance(dims, int) else dims
    type_id, offset = cur.unpack("<IQ")
    return name, tuple(reversed(dims)), type_id, offset


def _tensor_info(path: Path, shard: int, data_start: int, name: str,
                 shape: tuple[int, ...], type_id: int, offset: int) -> TensorInfo:
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {name!r} has type id {type_id}, which is no "
                             f"GGML type fusegen knows; supported: {supported}") from None
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block:
        raise ModelLoadError(f"{path}: tensor {name!r} rows of {shape[-1]} values do not "
                             f"fill whole {qtype.name} blocks of {block}; the file is damaged")
    numel = math.prod(shape)  # exact: a damaged shape's product must not wrap to a small size
    return TensorInfo(name, shape, qtype, data_start + offset, numel // block * block_bytes,
                      shard)
