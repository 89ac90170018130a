"""AWQ-style activation-aware scaling for `fusegen quantize --method awq`.

Calibration prompts run through fusegen's engine (fp32, CPU) while each decoder linear's
input is recorded (mean |x| per input channel and a sample of rows). For each group of
linears sharing an input (q/k/v, o, gate/up, down) the search tries s = mean|x|^alpha
over a grid of alphas and keeps the one whose quantized weight (w * s) gives the least
output error on the recorded rows against the dense weight (alpha 0 is round-to-nearest,
so the result is never worse than it). `fold` then moves 1/s into the op before the
linear (the norm for q/k/v and gate/up, v's rows for o, up's rows for down): in fp32 the
folded model computes the same function.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fusegen.engine.models import get_architecture
from fusegen.engine.weights.quantize import QUANTIZED_PARAMS, QuantizeError

if TYPE_CHECKING:
    from fusegen.engine.weights.quantize import QuantizeSpec, Report, Source

_NUM_ALPHAS = 20
_SAMPLE_ROWS = 512  # calibration rows kept per linear for the error of each alpha
_MAX_PROMPT_TOKENS = 512  # a longer calibration prompt is cut to its first tokens


class _Recorder(torch.nn.Module):
    """Wraps a layer's linear for the calibration pass (a Linear's `__call__` is its
    `forward`, so module hooks never fire): mean |x| per input channel over every row,
    and every `stride`-th row kept."""

    def __init__(self, inner, stride: int):
        super().__init__()
        self.inner, self.stride = inner, stride
        self.sum_abs, self.count, self.rows, self.seen = None, 0, [], 0

    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1]).float()  # [T, in]
        total = rows.abs().sum(0)
        self.sum_abs = total if self.sum_abs is None else self.sum_abs + total
        self.count += rows.shape[0]
        first = -self.seen % self.stride  # the next kept row's index in this call
        self.rows.append(rows[first::self.stride].clone())
        self.seen += rows.shape[0]
        return self.inner(x)

    __call__ = forward

    def set_weight(self, name, tensor):  # a streamed layer's weights arrive through here
        self.inner.set_weight(name, tensor)

    def activations(self) -> tuple[torch.Tensor, torch.Tensor]:
        """mean |x| [in], kept rows [n, in]."""
        return self.sum_abs / self.count, torch.cat(self.rows)


def calibrate(source: Source, prompts: list[str]) -> dict[tuple[int, str], tuple]:
    """(layer, "qkv" | "o" | "gate_up" | "down") -> (mean |x| [in], rows [n, in]) of each
    dense linear's input over the prompts, run through fusegen's engine in fp32 on the
    CPU. MoE experts are not recorded (their MLPs are quantized round-to-nearest)."""
    from fusegen.engine.llm import LLM
    from fusegen.engine.sampling_params import SamplingParams
    from fusegen.engine.models.moe import ExpertLinear

    max_len = min(source.cfg.max_position_embeddings, _MAX_PROMPT_TOKENS + 1)
    # dequantize: a GGUF file's weights expanded to fp32, the values the search quantizes
    with LLM(str(source.path), dtype="float32", device="cpu", max_model_len=max_len,
             enable_prefix_caching=False, quantization="dequantize") as llm:
        ids = [t[:max_len - 1] for t in llm.tokenizer.encode_batch(prompts) if t]
        stride = max(1, math.ceil(sum(map(len, ids)) / _SAMPLE_ROWS))
        recorders = {}
        for i, layer in enumerate(llm.engine.runner.model.layers):
            for attr in ("qkv", "o", "gate_up", "down"):
                inner = getattr(layer, attr)
                if isinstance(inner, ExpertLinear):
                    continue
                recorders[i, attr] = _Recorder(inner, stride)
                setattr(layer, attr, recorders[i, attr])
        llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return {key: rec.activations() for key, rec in recorders.items() if rec.count}


def _search(w: torch.Tensor, mean_abs: torch.Tensor, x: torch.Tensor, spec: QuantizeSpec
            ) -> tuple[torch.Tensor, float, float, float]:
    """w [out, in], mean_abs [in], x [n, in] -> (s [in], alpha, its error, RTN's error):
    the alpha whose s = mean_abs^alpha (normalised to a geometric mean of 1 between its
    extremes) gives the least mean squared error of x @ w.T against
    (x / s) @ dequantize(quantize(w * s)).T."""
    from fusegen.kernels.group_linear import dequantize_group, quantize_group

    reference = x @ w.t()
    best = None
    for k in range(_NUM_ALPHAS):
        alpha = k / (_NUM_ALPHAS - 1)
        s = mean_abs.clamp(min=1e-4) ** alpha
        s = s / (s.max() * s.min()).sqrt()
        try:
            qweight, scales, zeros = quantize_group(w * s, spec.bits, spec.group_size,
                                                    spec.symmetric)
        except ValueError:  # a scale past fp16's range: not this alpha (RTN's own: raised)
            if k == 0:
                raise
            continue
        dense = dequantize_group(qweight, scales, zeros, spec.bits, spec.group_size,
                                 w.shape[1])
        error = (reference - (x / s) @ dense.t()).pow(2).mean().item()
        if k == 0:
            rtn = error
        if best is None or error < best[2]:
            best = (s, alpha, error)
    return (*best, rtn)


@dataclass(slots=True)
class LayerScales:
    """One layer's AWQ scales, each over its linear's input channels: q/k/v's and
    gate/up's [h], o's [H * D], down's [I]; None where not scaled."""
    qkv: torch.Tensor | None = None
    o: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None


def search_scales(source: Source, activations: dict, spec: QuantizeSpec, report: Report
                  ) -> dict[int, LayerScales]:
    """Each layer's scales from its recorded inputs. o's input channel (head h, dim d) is
    v's row (kv head h // (H / K), d): its scales are shared by the query heads of one
    kv head (their mean |x| averaged), so that v's rows can take 1/s."""
    cfg, arch = source.cfg, get_architecture(source.cfg.architecture)
    scales = {}
    for i in range(cfg.num_layers):
        fused = _fused_weights(source, arch, i)
        layer = LayerScales()
        for group in ("qkv", "o", "gate_up", "down"):
            if (i, group) not in activations or group + ".weight" not in fused:
                continue
            mean_abs, rows = activations[i, group]
            if group == "o":
                grouped = mean_abs.view(cfg.num_kv_heads, -1, cfg.head_dim)  # [K, H / K, D]
                mean_abs = grouped.mean(1, keepdim=True).expand_as(grouped).reshape(-1)
            try:
                s, alpha, error, rtn = _search(fused[group + ".weight"], mean_abs, rows, spec)
            except ValueError as exc:  # inf / NaN, or a scale past fp16
                raise QuantizeError(f"layer {i}'s {group} weight: {exc}", "model") from None
            setattr(layer, group, s)
            report.searches[i, group] = (alpha, error, rtn)
        scales[i] = layer
    return scales


def _fused_weights(source: Source, arch, index: int) -> dict[str, torch.Tensor]:
    """Layer `index`'s dense linears as the engine fuses them (q/k/v into qkv), fp32."""
    prefix = arch.layer_prefix.format(index)
    # MoE experts are quantized round-to-nearest: only their attention is scaled
    scaled = QUANTIZED_PARAMS[:2] if source.cfg.num_experts else QUANTIZED_PARAMS
    parts: dict[str, list] = {}
    for name, _, param in arch.layer_tensors(source.cfg):
        if param in scaled:
            parts.setdefault(param, []).append(source.read(prefix + name).float())
    return {param: torch.cat(p) for param, p in parts.items()}


def fold(source: Source, scales: dict[int, LayerScales]) -> Callable:
    """(name, fp32 tensor) -> the tensor with the scales folded in: s into the scaled
    linears' columns, 1/s into the norms and into v's and up's rows (and biases). A
    Gemma norm, applied as (1 + w), becomes (1 + w) / s - 1."""
    from fusegen.engine.models.gemma import GemmaFamily

    cfg, arch = source.cfg, get_architecture(source.cfg.architecture)
    specs = arch.layer_tensors(cfg)
    params = {param for _, _, param in specs}
    mlp_norm = "pre_mlp_norm" if "pre_mlp_norm" in params else "post_norm"
    gemma = isinstance(arch, GemmaFamily)
    offsets, used = {}, {}  # each tensor's first row in its fused parameter
    for name, shape, param in specs:
        offsets[name] = used.get(param, 0)
        used[param] = offsets[name] + shape[0]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fused_rows = {"qkv": (q + kv, q + 2 * kv), "gate_up": (cfg.intermediate_size,
                                                          2 * cfg.intermediate_size)}
    by_name = {arch.layer_prefix.format(i) + name: (i, name, param)
               for i in range(cfg.num_layers) for name, _, param in specs}

    def divide_rows(t, start: int, rows: tuple[int, int], s):
        # the rows of this tensor inside the fused range `rows`, divided by s's entries
        lo, hi = max(rows[0], start), min(rows[1], start + t.shape[0])
        if lo < hi:
            t[lo - start:hi - start] /= s[lo - rows[0]:hi - rows[0]].unsqueeze(-1) \
                if t.dim() == 2 else s[lo - rows[0]:hi - rows[0]]
        return t

    def v_rows(o_scale):
        # o's scales [H * D], equal across the query heads of a kv head -> v's rows [K * D]
        return None if o_scale is None else \
            o_scale.view(cfg.num_kv_heads, -1, cfg.head_dim)[:, 0].reshape(-1)

    def apply(name: str, t: torch.Tensor) -> torch.Tensor:
        if name not in by_name or by_name[name][0] not in scales:
            return t
        i, local, param = by_name[name]
        layer = scales[i]
        group, _, kind = param.partition(".")
        norm_scale = {"input_norm": layer.qkv, mlp_norm: layer.gate_up}.get(param)
        if norm_scale is not None:
            return (1 + t) / norm_scale - 1 if gemma else t / norm_scale
        inner = {"qkv": v_rows(layer.o), "gate_up": layer.down}.get(group)
        if inner is not None:
            t = divide_rows(t, offsets[local], fused_rows[group], inner)
        column = getattr(layer, group, None) if kind == "weight" else None
        return t * column if column is not None else t

    return apply
