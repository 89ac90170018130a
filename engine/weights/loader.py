"""Reading a Hugging Face checkpoint directory into named tensors.

Only safetensors are read by default: they hold data, never code. Pickle files
(`*.bin`, `*.pt`) load only with `allow_pickle=True`, and then with
`torch.load(weights_only=True)`, which refuses arbitrary objects. Nothing from the
checkpoint directory is ever imported or executed.
"""
from __future__ import annotations

import json
import mmap
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.weights.compressed import CompressedSource
from fusegen.engine.weights.fp8 import SCALE_SUFFIXES, FP8Checkpoint, fp8_checkpoint, fp8_entry
from fusegen.engine.weights.groupquant import (COMPONENT_SUFFIXES, checkpoint_format,
                                               on_load_format, quantizable,
                                               quantize_on_load, read_group_checkpoint)
from fusegen.engine.weights.sparse import (CONFIG_KEY, SUFFIXES, SparseFormat,
                                           read_sparse_checkpoint, sparsity_config)

_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")
# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(model_dir: Path, allow_pickle: bool = False) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p for pat in _PICKLE_PATTERNS for p in model_dir.glob(pat))
    if pickles and not allow_pickle:
        raise ModelLoadError(
            f"{model_dir}: only pickle weights found ({pickles[0].name}); pickle files can "
            "run code when loaded, so fusegen refuses them. Convert the checkpoint to "
            "safetensors, or opt in with allow_pickle=True (--allow-pickle), which loads "
            "them with torch.load(weights_only=True).")
    if pickles:
        return pickles
    raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
              "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints' codes (weights/fp8.py)
              "U64": torch.uint64}  # sparse checkpoints' tile bitmaps (weights/sparse.py)


def _safetensors_views(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Zero-copy views into a memory-mapped safetensors file: the data is read from
    disk (or the page cache) only when a tensor is used, so weights that stay on the
    disk tier cost no host memory."""
    try:
        with open(path, "rb") as f:
            header_len, header = _read_header(f)
            # A private (copy-on-write) mapping: writable for torch, never written.
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read safetensors ({exc})") from None
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = _ST_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        count = (end - start) // dtype.itemsize
        numel = 1
        for size in info["shape"]:
            numel *= size
        if end - start != numel * dtype.itemsize or start > end:
            raise ModelLoadError(
                f"{path}: tensor {name!r} is {info['dtype']} {info['shape']} "
                f"({numel * dtype.itemsize} bytes) but the header gives it bytes "
                f"{start}..{end}; the file is damaged")
        if base + end > len(mapped):
            raise ModelLoadError(
                f"{path}: truncated: tensor {name!r} ends at byte {base + end}, past the end "
                f"of the file ({len(mapped)} bytes); download or write it again")
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start) \
            if count else torch.empty(0, dtype=dtype)
        yield name, flat.view(info["shape"])


_MAX_HEADER = 100_000_000  # bytes: the safetensors format's own bound on its header


def _read_header(f) -> tuple[int, dict]:
    header_len = int.from_bytes(f.read(8), "little")
    if header_len > _MAX_HEADER:  # read as is, a damaged length would size the buffer
        raise ValueError(f"a header of {header_len} bytes; the format allows {_MAX_HEADER}")
    return header_len, json.loads(f.read(header_len))


def check_num_layers(cfg: ModelConfig, model_dir: Path, source: str) -> None:
    """config.json's layer count against the layers its safetensors hold, read from the
    index or the files' headers alone, before anything is sized per layer; the loader's
    name-by-name check follows. Checkpoints without safetensors are left to the loader."""
    names = _safetensors_names(model_dir)
    if names is None:
        return
    pattern = re.compile(re.escape(get_architecture(cfg.architecture).layer_prefix)
                         .replace(re.escape("{}"), r"(\d+)"))
    layers = {int(m[1]) for name in names if (m := pattern.match(name))}
    if len(layers) != cfg.num_layers or (layers and max(layers) != len(layers) - 1):
        held = f"numbered {min(layers)} to {max(layers)}" if layers else "none"
        raise ModelLoadError(f"{source}: num_hidden_layers is {cfg.num_layers}; expected "
                             f"{len(layers)}, the layers its weights hold ({held})"
                             + _missing_layers(cfg, model_dir, layers))


def _missing_layers(cfg: ModelConfig, model_dir: Path, layers: set[int]) -> str:
    """What a layer count short of config.json's points to where the folder lacks shards
    (model-0000i-of-0000n.safetensors): the layers whose tensors are absent and the
    missing files. '' where every shard is there (config.json may be the one wrong)."""
    absent = [i for i in range(cfg.num_layers) if i not in layers]
    shards = _missing_shards(model_dir)
    if not absent or not shards:
        return ""
    prefix = get_architecture(cfg.architecture).layer_prefix
    shown = ", ".join(prefix.format(i) + "*" for i in absent[:3])
    text = (f"; no tensors of layer{'s' * (len(absent) > 1)} {shown}"
            f"{f' and {len(absent) - 3} more' if len(absent) > 3 else ''}")
    return text + shards


def _missing_shards(model_dir: Path) -> str:
    """'; the checkpoint is sharded in n files and ... is missing ...' where the folder's
    shards (model-0000i-of-0000n.safetensors) are fewer than their names count; ''."""
    shards = [m for p in model_dir.glob("*.safetensors")
              if (m := re.fullmatch(r"(.*-)(\d+)-of-(\d+)\.safetensors", p.name))]
    if not shards:
        return ""
    head, number, total = shards[0].groups()
    names = [f"{head}{i:0{len(number)}d}-of-{total}.safetensors"
             for i in range(1, int(total) + 1)]
    gone = [n for n in names if not (model_dir / n).is_file()]
    if not gone:
        return ""
    index = "" if (model_dir / "model.safetensors.index.json").is_file() else \
        " (as is model.safetensors.index.json)"
    return (f"; the checkpoint is sharded in {int(total)} files and {', '.join(gone)} "
            f"{'is' if len(gone) == 1 else 'are'} missing from {model_dir}{index}: copy "
            "the missing files")


def _safetensors_names(model_dir: Path) -> list[str] | None:
    """The tensor names of the directory's safetensors (None: none, or unreadable: the
    loader says why)."""
    try:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            if not all((model_dir / shard).is_file() for shard in set(weight_map.values())):
                return None
            return list(weight_map)
        names = []
        for path in sorted(model_dir.glob("*.safetensors")):
            with open(path, "rb") as f:
                names += [name for name in _read_header(f)[1] if name != "__metadata__"]
        return names or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, Path, torch.Tensor]]:
    for path in files:
        if path.suffix == ".safetensors":
            for name, tensor in _safetensors_views(path):
                yield name, path, tensor
        else:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # noqa: BLE001 - any failure is the file's
                raise ModelLoadError(f"{path}: cannot load ({exc})") from None
            for name, tensor in state.items():
                yield name, path, tensor


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint must hold, with its shape (the architecture's)."""
    return get_architecture(cfg.architecture).checkpoint_shapes(cfg)


def declared_format(model_dir) -> object | None:
    """The quantized form a checkpoint directory's config.json declares: an
    `FP8Checkpoint` (quant_method "fp8"), a `GroupFormat` (fusegen's), a `SparseFormat`
    (a "sparsity_config": bitmap tiles, weights/sparse.py), or None.
    ModelLoadError naming the key for a declaration fusegen cannot run."""
    sparse = sparsity_config(model_dir)
    try:
        fp8 = fp8_checkpoint(model_dir)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    declared = fp8 if fp8 is not None else checkpoint_format(model_dir)
    if sparse is not None and declared is not None:
        raise ModelLoadError(f"{Path(model_dir) / 'config.json'}: it declares both a "
                             f"{CONFIG_KEY} and a quantization_config; a sparse checkpoint "
                             f"keeps int8 values in its tiles ({CONFIG_KEY}.values 'int8')")
    return sparse if sparse is not None else declared


def load_state_dict(model_dir: str | Path, cfg: ModelConfig,
                    allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Every weight as a memory-mapped CPU tensor in the checkpoint's own dtype,
    checked name by name and shape by shape against the config. Nothing is read
    into memory until a tensor is used. A fusegen group-quantized checkpoint's linears
    (weights/groupquant.py), an FP8 checkpoint's (weights/fp8.py) and a sparse
    checkpoint's (weights/sparse.py, their tile tables checked here) are lazy entries of
    their dequantized weights carrying their compressed form as `.compressed`."""
    model_dir = Path(model_dir)
    expected = expected_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    fmt = declared_format(model_dir)
    suffixes = (SCALE_SUFFIXES if isinstance(fmt, FP8Checkpoint) else tuple(SUFFIXES)
                if isinstance(fmt, SparseFormat) else COMPONENT_SUFFIXES)
    files: dict[str, Path] = {}
    components: dict[str, tuple[Path, torch.Tensor]] = {}
    for name, path, tensor in iter_tensors(weight_files(model_dir, allow_pickle)):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if fmt is not None and name.endswith(suffixes):
            components[name] = (path, tensor)  # a quantized linear's codes or scales
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding serves as the head
        if name not in expected:
            raise ModelLoadError(_unexpected(path, name, cfg, fmt))
        if tuple(tensor.shape) != expected[name]:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, but config.json "
                f"implies {expected[name]}; the config does not match the weights")
        if tensor.dtype == torch.float8_e4m3fn and not isinstance(fmt, FP8Checkpoint):
            raise ModelLoadError(
                f"{path}: tensor {name!r} is float8_e4m3fn, but config.json declares no "
                "quantization_config with quant_method 'fp8' (which says how its scales "
                "are stored); fusegen reads FP8 weights only from such checkpoints")
        state[name] = tensor
        files[name] = path
    if isinstance(fmt, FP8Checkpoint):
        _read_fp8(state, files, components, fmt, model_dir)
    elif fmt is not None:
        read = read_sparse_checkpoint if isinstance(fmt, SparseFormat) else \
            read_group_checkpoint
        for name, entry in read(components, expected, fmt, model_dir).items():
            if name in state:
                raise ModelLoadError(f"{model_dir}: {name!r} is stored both dense and "
                                     "quantized; the checkpoint holds one of them")
            state[name] = entry
    missing = [n for n in expected if n not in state]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{model_dir}: weights missing for {', '.join(missing[:3])}{more}"
                             + _missing_shards(model_dir))
    return state


def _unexpected(path: Path, name: str, cfg: ModelConfig, fmt) -> str:
    """Why tensor `name` is not one the config expects: a compressed form's part that the
    config.json does not declare (its entry removed, or another's), or a stray."""
    undeclared = [(tuple(SUFFIXES), f"a sparse tile table ({', '.join(SUFFIXES)}), but "
                   f"config.json has no {CONFIG_KEY!r} entry that describes the sparse tiles"
                   f" (restore it: `fusegen sparsify` writes it)"),
                  (COMPONENT_SUFFIXES, "a group-quantized linear's codes or scales, but "
                   "config.json has no fusegen quantization_config that describes them "
                   "(restore it: `fusegen quantize` writes it)"),
                  (SCALE_SUFFIXES, "an FP8 weight's scale, but config.json has no "
                   "quantization_config with quant_method 'fp8'")]
    for suffixes, why in undeclared:
        if name.endswith(suffixes):
            return f"{path}: tensor {name!r} is {why}"
    return f"{path}: unexpected tensor {name!r} for {cfg.architecture} with this config.json"


def _read_fp8(state: dict[str, torch.Tensor], files: dict[str, Path],
              scales: dict[str, tuple[Path, torch.Tensor]], fmt: FP8Checkpoint,
              model_dir: Path) -> None:
    """An FP8 checkpoint's e4m3 linear weights in `state` as `fp8_entry`s, each with its
    `weight_scale` or `weight_scale_inv` from `scales` (taken out of it; `input_scale`s
    are not used); a scale without its e4m3 weight is named."""
    for name in [n for n, t in state.items() if t.dtype == torch.float8_e4m3fn]:
        base = name.removesuffix(".weight")
        scale, scale_inv = (scales.pop(base + suffix, (None, None))[1]
                            for suffix in (".weight_scale", ".weight_scale_inv"))
        scales.pop(base + ".input_scale", None)
        try:
            state[name] = fp8_entry(base, state[name], scale, scale_inv, fmt.block)
        except ValueError as exc:
            raise ModelLoadError(f"{files[name]}: {exc}") from None
    stray = sorted(n for n in scales if not n.endswith(".input_scale"))
    if stray:
        base = stray[0].rpartition(".")[0]
        raise ModelLoadError(f"{scales[stray[0]][0]}: tensor {stray[0]!r} scales "
                             f"{base + '.weight'!r}, which is not a float8_e4m3fn weight of "
                             f"this checkpoint ({model_dir})")


def checkpoint_tensors(model, cfg: ModelConfig, dtype: torch.dtype, quantization: str,
                       allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Every weight under its Hugging Face name, none read yet: memory-mapped safetensors
    or a GGUF file's tensors, each converted into `dtype` when used. `quantization` (the
    resolved form, `EngineConfig.quantization`) decides which entries also carry their
    compressed form as `.compressed`: a GGUF file's block-quantized tensors under "gguf";
    a fusegen-quantized checkpoint's linears and an FP8 checkpoint's (but its MoE
    experts') always; a 16-bit checkpoint's decoder linears under "int8" / "int4"
    (quantized on load, weights/groupquant.py) or "fp8"."""
    from fusegen.engine.weights.gguf_names import is_gguf

    if is_gguf(model):
        from fusegen.engine.weights.gguf import load_gguf_state_dict  # the gguf package

        return load_gguf_state_dict(model, cfg, dtype, keep_blocks=quantization == "gguf")
    state = load_state_dict(model, cfg, allow_pickle)
    declared = declared_format(Path(model))
    arch = get_architecture(cfg.architecture)
    layer_tensors = {arch.layer_prefix.format(i) + name: param
                     for i in range(cfg.num_layers)
                     for name, _, param in arch.layer_tensors(cfg)}
    if isinstance(declared, FP8Checkpoint) and cfg.num_experts:
        for name, param in layer_tensors.items():  # no FP8 expert linear: dense
            if param in _EXPERT_PARAMS and hasattr(state[name], "compressed"):
                del state[name].compressed
    if quantization in ("int8", "int4", "fp8") and declared is None:
        if quantization == "fp8":
            fp8_on_load(state, layer_tensors, dtype, experts=bool(cfg.num_experts))
        else:
            quantize_on_load(state, layer_tensors, on_load_format(quantization))
    return state


_EXPERT_PARAMS = ("gate_up.weight", "down.weight")  # an MoE layer's experts' weights


def fp8_on_load(state: dict[str, torch.Tensor], layer_tensors: dict[str, str],
                dtype: torch.dtype, experts: bool) -> None:
    """quantization="fp8": each decoder-layer linear weight of a 16-bit checkpoint gets an
    "fp8" `.compressed` source, its e4m3 codes and per-row scales made (as
    `FP8Linear.from_linear` makes them) from the weight in the run's `dtype` when read.
    MoE experts stay dense (no FP8 expert linear)."""
    for name, param in layer_tensors.items():
        tensor = state[name]
        if not quantizable(param, tuple(tensor.shape)) or (
                experts and param in _EXPERT_PARAMS):
            continue
        tensor.compressed = CompressedSource.of("fp8", (), tuple(tensor.shape), name,
                                                partial(_fp8_parts, tensor, dtype))


def _fp8_parts(tensor: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from fusegen.kernels.triton_quant import quantize_fp8

    codes, scale = quantize_fp8(tensor.to(dtype))
    return {"weight_fp8": codes, "weight_scale": scale}


def fuse(sources: dict[str, list[torch.Tensor]], device, dtype) -> dict[str, torch.Tensor]:
    """A layer's parameters, each its source tensors stacked along dim 0, in `dtype`
    on `device`; always a copy (the checkpoint's tensors stay untouched)."""
    return {name: torch.cat([t.to(dtype) for t in parts]).to(device) if len(parts) > 1
            else parts[0].to(device, dtype, copy=True) for name, parts in sources.items()}
