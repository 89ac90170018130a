"""`FP8Linear`: a linear whose weight is float8_e4m3fn codes with one fp32 scale per
output channel (weight ~= weight_fp8 * weight_scale[:, None]), multiplied by
`kernels/triton_quant.fp8_linear`: torch._scaled_mm on GPUs with FP8 units (compute
capability 8.9 or later: Ada, Hopper, Blackwell), each row of x quantized to e4m3 on the
fly; on CPUs the same arithmetic in torch (the fallback, for tests and small runs).
A CUDA GPU without FP8 units is refused: its fallback would expand the weight to 16 bits
on every call, slower than the dense model it replaces.

Two ways in:
- `FP8Linear.from_linear(linear)` quantizes a dense `Linear`'s weight as it loads (the
  largest |value| of each output channel maps to e4m3's 448);
- `fp8_checkpoint_parts(...)` reads a Hugging Face FP8 checkpoint's tensors for one
  linear: `NAME.weight` in e4m3 with `NAME.weight_scale` (per tensor or per output
  channel, as compressed-tensors and fbgemm_fp8 write them; kept exactly) or
  `NAME.weight_scale_inv` (128 x 128 blocks, as DeepSeek-V3 and Qwen3-FP8 write them;
  dequantized and re-quantized per output channel, which rounds each weight once more).

A checkpoint whose config.json declares `quantization_config.quant_method` "fp8"
(`fp8_checkpoint`) is read by the loader through `fp8_entry`: each FP8 linear weight is
a lazy tensor of its dequantized values (quantization="dequantize", any device) carrying
an "fp8" `CompressedSource` of `fp8_checkpoint_parts` (kept as FP8Linear on GPUs with
FP8 units). The activations are quantized per row at run time: a checkpoint's static
`input_scale` tensors are not used.

Tensors ("weight_fp8", "weight_scale", "bias") are set by `set_weight`, shared, not
copied, and checked: dtype, shape, and that their device has FP8 units.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from fusegen.engine.weights.compressed import CompressedLinear, CompressedSource
from fusegen.engine.weights.groupquant import quantization_config
from fusegen.engine.weights.lazy import LazyTensor
from fusegen.engine.weights.linear import Linear, row_tiled
from fusegen.kernels.triton_quant import fp8_linear, has_fp8_units, quantize_fp8

WEIGHT_BLOCK = (128, 128)  # weight_scale_inv's block: [output rows, input channels]
QUANT_METHOD = "fp8"  # config.json's quantization_config.quant_method
# A linear's tensors beside NAME.weight in an FP8 checkpoint
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


@dataclass(frozen=True, slots=True)
class FP8Checkpoint:
    """What an FP8 checkpoint's `quantization_config` says: the block of its
    `weight_scale_inv` tensors ([output rows, input channels]; `weight_block_size`)."""
    block: tuple[int, int] = WEIGHT_BLOCK
    name: str = "fp8"


def fp8_checkpoint(model) -> FP8Checkpoint | None:
    """The FP8 format a checkpoint directory's config.json declares
    (`quantization_config.quant_method` "fp8", as transformers' FP8 and DeepSeek / Qwen
    FP8 checkpoints write it), or None. ValueError naming the key for a
    `weight_block_size` that is not two positive integers."""
    path, qc = quantization_config(model)
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        return None
    block = qc.get("weight_block_size") or WEIGHT_BLOCK
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{path}: quantization_config.weight_block_size is {block!r}; it "
                         "must be two positive integers [output rows, input channels]")
    return FP8Checkpoint(tuple(block))


def check_fp8_device(device: torch.device | str, what: str = "FP8Linear") -> None:
    """RuntimeError naming the device and its capability where FP8 weights cannot run:
    a CUDA GPU older than capability 8.9. CPUs run the torch fallback."""
    device = torch.device(device)
    if device.type == "cpu" or has_fp8_units(device):
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        raise RuntimeError(
            f"{what}: {device} ({torch.cuda.get_device_name(device)}) has compute capability "
            f"{major}.{minor}; FP8 weights need 8.9 or later (Ada, Hopper, Blackwell). Load "
            "this model in bfloat16, or quantize it to int8 / int4 instead")
    raise RuntimeError(f"{what}: device {device} has no FP8 matmul in fusegen; FP8 weights "
                       "run on CUDA GPUs of capability 8.9 or later, or on the CPU")


class FP8Linear(CompressedLinear):
    """x [T, in] -> x @ (weight_fp8 * weight_scale[:, None]).T + bias [T, out];
    weight_fp8 float8_e4m3fn [out, in], weight_scale fp32 [out], bias [out] dense."""
    components = ("weight_fp8", "weight_scale")
    format = "fp8"

    @classmethod
    def from_linear(cls, linear: Linear) -> "FP8Linear":
        """`linear`'s weight quantized to e4m3 per output channel, on its device; its bias
        (flag and tensor) and row tile kept."""
        weight = linear.weight
        if weight is None or weight.dim() != 2 or weight.numel() == 0:
            shape = None if weight is None else list(weight.shape)
            raise ValueError(f"FP8Linear.from_linear: the linear's weight is {shape}; "
                             "it needs its dense [out, in] weight loaded")
        check_fp8_device(weight.device)
        module = cls(bias=linear.bias is not None)
        module.bias = linear.bias
        module.row_tile = linear.row_tile
        module.out_features, module.in_features = weight.shape
        weight_fp8, scale = quantize_fp8(weight)
        module.set_weight("weight_fp8", weight_fp8)
        module.set_weight("weight_scale", scale)
        return module

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name == "weight_fp8":
            if tensor.dtype != torch.float8_e4m3fn or tensor.dim() != 2:
                raise ValueError(f"FP8Linear weight_fp8 is float8_e4m3fn [out, in]; got "
                                 f"{tensor.dtype} {list(tensor.shape)}")
            if self.out_features and tuple(tensor.shape) != (self.out_features, self.in_features):
                raise ValueError(f"FP8Linear weight_fp8 is [{self.out_features}, "
                                 f"{self.in_features}]; got {list(tensor.shape)}")
            self.out_features, self.in_features = tensor.shape
            check_fp8_device(tensor.device)
        elif name == "weight_scale":
            if tensor.dtype != torch.float32 or tensor.dim() != 1 or (
                    self.out_features and tensor.shape[0] != self.out_features):
                raise ValueError(f"FP8Linear weight_scale is float32 "
                                 f"[{self.out_features or 'out'}] (one per output channel); "
                                 f"got {tensor.dtype} {list(tensor.shape)}")
        super().set_weight(name, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile is not None:
            # Each row of x gets its own e4m3 scale, but cuBLASLt (and torch's CPU GEMM)
            # pick their summation order by the call's shape: exactly `row_tile` rows a
            # call make a row's result independent of the rows batched with it.
            return row_tiled(x, self._matmul, self.out_features, self.bias, self.row_tile)
        shape = x.shape
        out = fp8_linear(x.reshape(-1, self.in_features), self.weight_fp8, self.weight_scale,
                         self.bias)
        return out.view(*shape[:-1], self.out_features)

    def _matmul(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # rows [n, in] -> [n, out], no bias: one call of row_tiled's
        result = fp8_linear(rows, self.weight_fp8, self.weight_scale)
        return result if out is None else out.copy_(result)


def fp8_checkpoint_parts(name: str, weight: torch.Tensor,
                         weight_scale: torch.Tensor | None = None,
                         weight_scale_inv: torch.Tensor | None = None,
                         block: tuple[int, int] = WEIGHT_BLOCK
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Hugging Face FP8 checkpoint's tensors for linear `name` ("...q_proj") ->
    (weight_fp8 e4m3 [out, in], weight_scale fp32 [out]) for `FP8Linear.set_weight`.

    `weight_scale`: [] / [1] (per tensor) or [out] / [out, 1] (per output channel), with
    weight = weight * scale: kept exactly (a per-tensor scale repeated per channel).
    `weight_scale_inv`: [ceil(out / b0), ceil(in / b1)] for `block` (b0, b1) (the config's
    `weight_block_size`), weight = weight * scale_inv[o // b0, i // b1]: dequantized to
    fp32 and quantized again per output channel."""
    check_fp8_checkpoint(name, weight, weight_scale, weight_scale_inv, block)
    if weight_scale is not None:
        scale = weight_scale.float()
        return weight, scale.reshape(-1).expand(weight.shape[0]).contiguous()
    return quantize_fp8(dequantize_fp8_checkpoint(weight, weight_scale, weight_scale_inv,
                                                  block))


def check_fp8_checkpoint(name: str, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                         weight_scale_inv: torch.Tensor | None,
                         block: tuple[int, int] = WEIGHT_BLOCK) -> None:
    """ValueError naming the tensor where an FP8 linear's tensors do not fit together
    (`fp8_checkpoint_parts` says what they are); nothing is read."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{name}.weight is {weight.dtype} {list(weight.shape)}; an FP8 "
                         "checkpoint's linear weight is float8_e4m3fn [out, in]")
    if (weight_scale is None) == (weight_scale_inv is None):
        raise ValueError(f"{name}: an FP8 weight comes with one of {name}.weight_scale or "
                         f"{name}.weight_scale_inv; got "
                         f"{'both' if weight_scale is not None else 'neither'}")
    out_features, in_features = weight.shape
    if weight_scale is not None:
        if weight_scale.numel() == 1 or (weight_scale.numel() == out_features
                                         and 1 <= weight_scale.dim() <= 2
                                         and weight_scale.shape[0] == out_features):
            return
        raise ValueError(f"{name}.weight_scale is {list(weight_scale.shape)}; fusegen reads a "
                         f"per-tensor [] or per-channel [{out_features}] / [{out_features}, 1] "
                         "scale")
    b0, b1 = block
    want = (-(-out_features // b0), -(-in_features // b1))
    if tuple(weight_scale_inv.shape) != want:
        raise ValueError(f"{name}.weight_scale_inv is {list(weight_scale_inv.shape)}; a "
                         f"{out_features} x {in_features} weight in {b0} x {b1} blocks has "
                         f"{list(want)}")


def dequantize_fp8_checkpoint(weight: torch.Tensor, weight_scale: torch.Tensor | None,
                              weight_scale_inv: torch.Tensor | None,
                              block: tuple[int, int] = WEIGHT_BLOCK) -> torch.Tensor:
    """An FP8 linear's dense weight in fp32 [out, in]: each code times its scale (per
    tensor, per output channel, or per `block` of `weight_scale_inv`), one fp32 product."""
    out_features, in_features = weight.shape
    if weight_scale is not None:
        scale = weight_scale.float()
        scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(out_features, 1)
        return weight.float() * scale
    b0, b1 = block
    scale = weight_scale_inv.float().repeat_interleave(b0, 0)[:out_features]
    scale = scale.repeat_interleave(b1, 1)[:, :in_features]
    return weight.float() * scale


def fp8_entry(name: str, weight: torch.Tensor, weight_scale: torch.Tensor | None,
              weight_scale_inv: torch.Tensor | None, block: tuple[int, int]) -> torch.Tensor:
    """The state-dict entry of an FP8 checkpoint's linear `name` ("...q_proj"): a lazy
    fp32 tensor of its dequantized weight carrying an "fp8" `.compressed` source of
    `fp8_checkpoint_parts` (checked here, read only when used)."""
    check_fp8_checkpoint(name, weight, weight_scale, weight_scale_inv, block)
    entry = LazyTensor(tuple(weight.shape), torch.float32, partial(
        dequantize_fp8_checkpoint, weight, weight_scale, weight_scale_inv, block))
    entry.compressed = CompressedSource.of("fp8", (), tuple(weight.shape), f"{name}.weight",
                                           partial(_parts, name, weight, weight_scale,
                                                   weight_scale_inv, block))
    return entry


def _parts(*args) -> dict[str, torch.Tensor]:
    weight_fp8, weight_scale = fp8_checkpoint_parts(*args)
    return {"weight_fp8": weight_fp8, "weight_scale": weight_scale}
