"""fusegen's group-quantized int8 / int4 weights (docs/quantization.md) at run time:
`GroupQuantLinear` and its MoE expert form hold the codes, scales and zero points and
multiply through `kernels/group_linear.py`; `read_group_checkpoint` serves a
fusegen-quantized checkpoint's linears as compressed entries; `quantize_on_load` gives a
16-bit checkpoint's decoder linears group-quantized sources (round to nearest).

A quantized linear's tensors in the checkpoint are `NAME.qweight`, `NAME.scales` and
(asymmetric) `NAME.zeros` instead of `NAME.weight`; the state dict serves `NAME.weight`
as a lazy tensor that dequantizes when used as a dense one, carrying the codes as its
`.compressed` source (format "group", params (bits, group_size, symmetric)).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from fusegen.engine.errors import ModelLoadError
from fusegen.engine.weights.linear import Linear, row_tiled
from fusegen.engine.weights.compressed import (GROUP_BITS, GROUP_SIZES, CompressedLinear,
                                               CompressedSource, component_shapes,
                                               expert_product, expert_shell)
from fusegen.engine.weights.lazy import LazyTensor
from fusegen.kernels import use_native, use_triton

QUANT_METHOD = "fusegen"
# On-load quantization ("int8" / "int4" on a 16-bit checkpoint): round to nearest,
# symmetric groups of this many input channels.
ON_LOAD_GROUP_SIZE = 128
ON_LOAD_SYMMETRIC = True
COMPONENT_SUFFIXES = (".qweight", ".scales", ".zeros")
# The layer parameters that are never quantized although they are 2-D weights.
_DENSE_PARAMS = ("router.weight",)


@dataclass(frozen=True, slots=True)
class GroupFormat:
    """A checkpoint's `quantization_config`: how its linears are stored."""
    bits: int
    group_size: int
    symmetric: bool

    @property
    def params(self) -> tuple:
        return (self.bits, self.group_size, self.symmetric)

    @property
    def name(self) -> str:
        return f"int{self.bits}"


def quantization_config(model) -> tuple[Path, object]:
    """A checkpoint directory's config.json path and the `quantization_config` it holds,
    as written (None where there is none, or no readable config.json: not a checkpoint
    directory, or one whose config the config reader refuses with the reason)."""
    path = Path(model) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return path, None
    return path, raw.get("quantization_config") if isinstance(raw, dict) else None


def checkpoint_format(model) -> GroupFormat | None:
    """The group format a checkpoint directory's config.json declares
    (`quantization_config` with quant_method "fusegen"), or None for a checkpoint that
    declares none. ModelLoadError naming the key for a declaration fusegen cannot run."""
    path, qc = quantization_config(model)
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ModelLoadError(
            f"{path}: quantization_config's quant_method is {method!r}; fusegen runs its own "
            f"group-quantized checkpoints (quant_method {QUANT_METHOD!r}, written by "
            "`fusegen quantize`), GGUF files, Hugging Face FP8 checkpoints (quant_method "
            "'fp8') and unquantized checkpoints")
    bits, group_size, symmetric = (qc.get(k) for k in ("bits", "group_size", "symmetric"))
    if bits not in GROUP_BITS or isinstance(bits, bool):
        raise ModelLoadError(f"{path}: quantization_config.bits is {bits!r}; fusegen's group "
                             f"quantization is 8 or 4 bits")
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise ModelLoadError(f"{path}: quantization_config.group_size is {group_size!r}; "
                             f"it must be one of {', '.join(map(str, GROUP_SIZES))}")
    if not isinstance(symmetric, bool):
        raise ModelLoadError(f"{path}: quantization_config.symmetric is {symmetric!r}; it "
                             "must be true or false")
    return GroupFormat(bits, group_size, symmetric)


def read_group_checkpoint(tensors: dict[str, tuple[Path, torch.Tensor]],
                          expected: dict[str, tuple[int, ...]], fmt: GroupFormat,
                          model_dir: Path) -> dict[str, torch.Tensor]:
    """The quantized linears of a checkpoint as state-dict entries under their
    `NAME.weight` names. `tensors`: the checkpoint's `NAME.qweight/.scales/.zeros`
    tensors (name -> (file, tensor)), taken out of it here; `expected`: every weight
    name's dense shape. Each component is checked (dtype, shape) against the format."""
    out = {}
    for qname in [n for n in tensors if n.endswith(".qweight")]:
        base = qname.removesuffix(".qweight")
        weight = base + ".weight"
        path = tensors[qname][0]
        shape = expected.get(weight)
        if shape is None or len(shape) != 2:
            raise ModelLoadError(f"{path}: tensor {qname!r} quantizes {weight!r}, which is no "
                                 "linear weight of this architecture with this config.json")
        if shape[1] % fmt.group_size:
            raise ModelLoadError(f"{path}: tensor {qname!r}: {weight!r} has {shape[1]} input "
                                 f"channels, not a multiple of the group size "
                                 f"{fmt.group_size}")
        kind = (f"int{fmt.bits} {'symmetric' if fmt.symmetric else 'asymmetric'} in groups "
                f"of {fmt.group_size} (config.json's quantization_config)")
        parts = {}
        for name, (dtype, want) in component_shapes("group", fmt.params, shape).items():
            component = f"{base}.{name}"
            if component not in tensors:
                raise ModelLoadError(f"{model_dir}: tensor {component!r} is missing; "
                                     f"{weight!r} is stored {kind}, which needs it")
            file, tensor = tensors.pop(component)
            if tensor.dtype != dtype or tuple(tensor.shape) != want:
                raise ModelLoadError(
                    f"{file}: tensor {component!r} is {_dtype(tensor.dtype)} "
                    f"{list(tensor.shape)}; the {list(shape)} weight {weight!r} stored {kind} "
                    f"needs {_dtype(dtype)} {list(want)}")
            parts[name] = tensor
        if fmt.symmetric and f"{base}.zeros" in tensors:
            raise ModelLoadError(
                f"{tensors[base + '.zeros'][0]}: tensor {base + '.zeros'!r} holds zero points, "
                f"but the checkpoint is {kind}, which stores none; config.json and the "
                "weights disagree")
        out[weight] = compressed_entry(shape, fmt.params, weight, partial(dict, parts))
    stray = sorted(n for n in tensors if n.endswith(COMPONENT_SUFFIXES))
    if stray:
        base = stray[0].rpartition(".")[0]
        raise ModelLoadError(f"{tensors[stray[0]][0]}: tensor {stray[0]!r} has no "
                             f"{base + '.qweight'!r} beside it; the checkpoint is incomplete")
    return out


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compressed_entry(shape: tuple[int, int], params: tuple, name: str, read) -> torch.Tensor:
    """A state-dict entry for a group-quantized weight: a lazy tensor of the dense
    weight (fp32, dequantized when used) carrying its source as `.compressed`."""
    source = CompressedSource.of("group", params, shape, name, read)
    entry = LazyTensor(tuple(shape), torch.float32, partial(_dequantized, source))
    entry.compressed = source
    return entry


def _dequantized(source: CompressedSource) -> torch.Tensor:
    from fusegen.kernels.group_linear import dequantize_group

    bits, group_size, _ = source.params
    parts = source.load()
    return dequantize_group(parts["qweight"], parts["scales"], parts.get("zeros"), bits,
                            group_size, source.shape[1])


def on_load_format(quantization: str) -> GroupFormat:
    """The format quantization="int8" / "int4" gives a 16-bit checkpoint on load."""
    return GroupFormat(int(quantization.removeprefix("int")), ON_LOAD_GROUP_SIZE,
                       ON_LOAD_SYMMETRIC)


def quantizable(param: str, shape: tuple[int, ...]) -> bool:
    """Whether a decoder layer's checkpoint tensor for parameter `param` is one that
    int8 / int4 quantize: a linear's 2-D weight, not an MoE router."""
    return param.endswith(".weight") and len(shape) == 2 and param not in _DENSE_PARAMS


def quantize_on_load(state: dict[str, torch.Tensor], layer_tensors: dict[str, str],
                     fmt: GroupFormat) -> None:
    """Give each decoder-layer linear weight of a dense checkpoint (`layer_tensors`:
    checkpoint name -> layer parameter) a group-quantized `.compressed` source, its codes
    made from the weight (round to nearest) when read."""
    for name, param in layer_tensors.items():
        tensor = state[name]
        if quantizable(param, tuple(tensor.shape)):
            tensor.compressed = CompressedSource.of(
                "group", fmt.params, tuple(tensor.shape), name,
                partial(_quantized, tensor, fmt))


def _quantized(tensor: torch.Tensor, fmt: GroupFormat) -> dict[str, torch.Tensor]:
    from fusegen.kernels.group_linear import quantize_group

    qweight, scales, zeros = quantize_group(tensor, fmt.bits, fmt.group_size, fmt.symmetric)
    return {"qweight": qweight, "scales": scales} | ({} if zeros is None else {"zeros": zeros})


@functools.cache
def _kernel():
    from fusegen.kernels import group_linear

    return group_linear


@functools.cache
def _triton():
    from fusegen.kernels import triton_quant

    return triton_quant


class GroupQuantLinear(CompressedLinear):
    """W held as fusegen's group-quantized codes: `qweight` uint8 [out, in] (int8) or
    [out, in / 2] (int4), `scales` fp16 [out, G], `zeros` uint8 [out, G] or None
    (symmetric); params (bits, group_size, symmetric)."""
    components = ("qweight", "scales", "zeros")
    format = "group"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile is not None and not self._batch_invariant(x):
            # The C kernel sums each output in one order whatever the call; the reference
            # (torch's GEMM) by the call's shape: `row_tile` rows a call fix it.
            return row_tiled(x, self._matmul, self.out_features, self.bias, self.row_tile)
        out = self._product(x, self.qweight, self.scales, self.zeros, self.out_features)
        if self.bias is not None:
            out += self.bias
        return out

    def _batch_invariant(self, x: torch.Tensor) -> bool:
        if x.is_cuda:  # the Triton kernel's batch-invariant tiles (kernels/triton_quant.py)
            return use_triton(x) and _triton().has_triton_quant(x.device)
        return use_native(x) and _kernel().has_kernel(self.params[0], x.dtype)

    def _product(self, x, qweight, scales, zeros, out_features: int) -> torch.Tensor:
        bits, group_size, _ = self.params
        if x.is_cuda and use_triton(x) and _triton().has_triton_quant(x.device):
            # deterministic mode keeps the tiles whose sums do not depend on the batch
            return _triton().group_linear_triton(x, qweight, scales, zeros, bits, group_size,
                                                 out_features, self.in_features,
                                                 batch_invariant=self.row_tile is not None)
        return _kernel().group_linear(x, qweight, scales, zeros, bits, group_size,
                                      out_features, self.in_features)

    def _matmul(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # rows [n, in] -> [n, out], no bias: one call of row_tiled's
        result = self._product(rows, self.qweight, self.scales, self.zeros, self.out_features)
        return result if out is None else out.copy_(result)


class GroupQuantExpertLinear(GroupQuantLinear):
    """E experts' group-quantized weights stacked, as `ExpertLinear`'s: the loader and
    the streamer hand over [E * out, ...] components (the experts' rows in turn), held as
    [E, out, ...]; x [n, in] -> [n, out] through expert `expert`'s codes."""

    def __init__(self, bias: bool = False, num_experts: int = 1):
        super().__init__(bias=bias)
        self.num_experts = num_experts

    @classmethod
    def shell(cls, linear: Linear, source: CompressedSource) -> "GroupQuantExpertLinear":
        return expert_shell(super().shell(linear, source), linear, source)

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.components:
            tensor = tensor.view(self.num_experts, -1, tensor.shape[-1])
        super().set_weight(name, tensor)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        zeros = None if self.zeros is None else self.zeros[expert]
        product = partial(self._product, qweight=self.qweight[expert],
                          scales=self.scales[expert], zeros=zeros,
                          out_features=self.out_features)
        tiled = self.row_tile is not None and not self._batch_invariant(x)
        return expert_product(x, product, self.out_features,
                              self.row_tile if tiled else None)
