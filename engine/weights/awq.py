"""AWQ-style activation-aware scaling for `fusegen quantize --method awq`.

Calibration prompts run through fusegen's engine (fp32, CPU) while each decoder linear's
input is recorded (mean |x| and the L2 norm per input channel, and a sample of rows; an
MoE expert's per expert, on the rows routed to it; Wanda pruning, engine/weights/
sparsify.py, scores weights by those L2 norms). For each group of linears sharing an
input (q/k/v, o, gate/up, down) the search tries s = mean|x|^alpha over a grid of
alphas and keeps the one whose quantized weight (w * s) gives the least output error on
the recorded rows against the dense weight (alpha 0 is round-to-nearest, so the result
is never worse than it). `fold` then moves 1/s into the op before the linear (the norm for q/k/v and
gate/up, v's rows for o, up's rows for down): in fp32 the folded model computes the same
function.

Mixture of experts (as AutoAWQ scales Mixtral and Qwen-MoE): every expert's gate/up reads
the norm's output, which also feeds the router, so they share one s, searched over all
experts' gate/up weights with each expert's error measured on its own routed rows, and
folded into the norm (1/s), the experts' gate/up columns and the router's columns (s;
the router stays dense). Each expert's down has its own input: its own s, searched on
its routed rows and folded into its up rows and down columns. An expert no calibration
row was routed to keeps its down unscaled (round-to-nearest), and the report says so.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusegen.engine.models import get_architecture
from fusegen.engine.weights.quantize_spec import (QUANTIZED_PARAMS, QuantizeError, QuantizeSpec,
                                                  Report, Source)

_NUM_ALPHAS = 20
_SAMPLE_ROWS = 512  # calibration rows kept per linear for the error of each alpha
_MAX_PROMPT_TOKENS = 512  # a longer calibration prompt is cut to its first tokens


@dataclass(slots=True)
class Inputs:
    """One linear's recorded input: the sums of |x| and of x^2 per input channel over
    `count` rows, and a sample of those rows [n, in]."""
    sum_abs: torch.Tensor
    count: int
    rows: torch.Tensor
    sum_sq: torch.Tensor | None = None

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.sum_abs / self.count

    @property
    def l2_norm(self) -> torch.Tensor:
        """||x_k||_2 over every row seen, per input channel k [in]."""
        return self.sum_sq.sqrt()


class _Rows:
    """|x| and x^2 summed per input channel over every row seen, and every `stride`-th
    row kept (the first row seen always: an input seen at all has a sample)."""

    def __init__(self, stride: int):
        self.stride, self.sum_abs, self.sum_sq, self.count, self.rows = stride, None, None, 0, []

    def add(self, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).float()  # [T, in]
        total, squares = rows.abs().sum(0), rows.square().sum(0)
        self.sum_abs = total if self.sum_abs is None else self.sum_abs + total
        self.sum_sq = squares if self.sum_sq is None else self.sum_sq + squares
        first = -self.count % self.stride  # the next kept row's index in this call
        self.rows.append(rows[first::self.stride].clone())
        self.count += rows.shape[0]

    def inputs(self) -> Inputs:
        return Inputs(self.sum_abs, self.count, torch.cat(self.rows), self.sum_sq)


class _Recorder(torch.nn.Module):
    """Wraps a layer's linear for the calibration pass (a Linear's `__call__` is its
    `forward`, so module hooks never fire), recording its input."""

    def __init__(self, inner, stride: int):
        super().__init__()
        self.inner, self.seen = inner, _Rows(stride)

    def forward(self, x):
        self.seen.add(x)
        return self.inner(x)

    __call__ = forward

    def set_weight(self, name, tensor):  # a streamed layer's weights arrive through here
        self.inner.set_weight(name, tensor)

    def inputs(self) -> dict[int | None, Inputs]:
        return {None: self.seen.inputs()} if self.seen.count else {}


class _ExpertRecorder(torch.nn.Module):
    """Wraps an `ExpertLinear` as `_Recorder` wraps a linear: `forward(x, expert)` gets
    expert `expert`'s routed rows, recorded per expert."""

    def __init__(self, inner, stride: int):
        super().__init__()
        self.inner, self.num_experts = inner, inner.num_experts  # run_experts reads it
        self.seen = [_Rows(stride) for _ in range(inner.num_experts)]

    def forward(self, x, expert: int):
        self.seen[expert].add(x)
        return self.inner(x, expert)

    __call__ = forward

    def set_weight(self, name, tensor):
        self.inner.set_weight(name, tensor)

    def inputs(self) -> dict[int | None, Inputs]:
        return {e: rows.inputs() for e, rows in enumerate(self.seen) if rows.count}


def calibrate(source: Source, prompts: list[str]) -> dict[tuple[int, str, int | None], Inputs]:
    """(layer, "qkv" | "o" | "gate_up" | "down", expert) -> the `Inputs` of that linear
    over the prompts, run through fusegen's engine in fp32 on the CPU. `expert` is None
    for a dense linear; an MoE layer's gate_up and down are recorded per expert on the
    rows routed to it (an expert that got none has no entry). Up to 512 rows are kept
    per dense linear and per expert (each expert sees every token at most once, so a
    layer's experts keep up to 512 * k rows)."""
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
                wrap = _ExpertRecorder if isinstance(inner, ExpertLinear) else _Recorder
                recorders[i, attr] = wrap(inner, stride)
                setattr(layer, attr, recorders[i, attr])
        llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return {(i, attr, e): inputs for (i, attr), rec in recorders.items()
            for e, inputs in rec.inputs().items()}


def _search(w: torch.Tensor, mean_abs: torch.Tensor, parts: list[tuple[slice, torch.Tensor]],
            spec: QuantizeSpec) -> tuple[torch.Tensor, float, float, float]:
    """w [out, in], mean_abs [in], parts: (w's rows, the rows x [n, in] they read) ->
    (s [in], alpha, its error, RTN's error): the alpha whose s = mean_abs^alpha
    (normalised to a geometric mean of 1 between its extremes) gives the least mean
    squared error, over every part's outputs, of x @ w[rows].T against
    (x / s) @ dequantize(quantize(w * s))[rows].T. A dense linear is one part; an MoE
    layer's gate/up is one part per expert, its weights and routed rows."""
    from fusegen.kernels.group_linear import dequantize_group, quantize_group

    references = [x @ w[rows].t() for rows, x in parts]
    num_outputs = sum(r.numel() for r in references)
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
        error = sum((ref - (x / s) @ dense[rows].t()).pow(2).sum().item()
                    for ref, (rows, x) in zip(references, parts)) / num_outputs
        if k == 0:
            rtn = error
        if best is None or error < best[2]:
            best = (s, alpha, error)
    return (*best, rtn)


@dataclass(slots=True)
class LayerScales:
    """One layer's AWQ scales, each over its linear's input channels: q/k/v's and
    gate/up's [h], o's [H * D], down's [I]; None where not scaled. In an MoE layer
    gate_up is the experts' shared scale (the router's columns take it too), down is
    None and `expert_down` holds each scaled expert's [I]."""
    qkv: torch.Tensor | None = None
    o: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    expert_down: dict[int, torch.Tensor] = field(default_factory=dict)


def search_scales(source: Source, activations: dict, spec: QuantizeSpec, report: Report
                  ) -> dict[int, LayerScales]:
    """Each layer's scales from its recorded inputs (`calibrate`'s). o's input channel
    (head h, dim d) is v's row (kv head h // (H / K), d): its scales are shared by the
    query heads of one kv head (their mean |x| averaged), so that v's rows can take 1/s."""
    cfg, arch = source.cfg, get_architecture(source.cfg.architecture)
    dense_groups = ("qkv", "o") if cfg.num_experts else ("qkv", "o", "gate_up", "down")
    scales = {}
    for i in range(cfg.num_layers):
        fused = _fused_weights(source, arch, i)
        layer = LayerScales()
        for group in dense_groups:
            if (i, group, None) not in activations or group + ".weight" not in fused:
                continue
            inputs = activations[i, group, None]
            mean_abs = inputs.mean_abs
            if group == "o":
                grouped = mean_abs.view(cfg.num_kv_heads, -1, cfg.head_dim)  # [K, H / K, D]
                mean_abs = grouped.mean(1, keepdim=True).expand_as(grouped).reshape(-1)
            s = _searched(fused[group + ".weight"], mean_abs, [(slice(None), inputs.rows)],
                          spec, report, i, group)
            setattr(layer, group, s)
        if cfg.num_experts:
            _search_experts(fused, activations, cfg.num_experts, spec, report, i, layer)
        scales[i] = layer
    return scales


def _search_experts(fused: dict, activations: dict, num_experts: int, spec: QuantizeSpec,
                    report: Report, i: int, layer: LayerScales) -> None:
    """Layer i's expert scales into `layer`: the shared gate/up one ("moe gate_up"),
    each routed expert's down ("expert {e} down"); an expert with no routed rows is
    listed in `report.round_to_nearest`."""
    gate_up, down = fused["gate_up.weight"], fused["down.weight"]  # [E * 2I, h], [E * h, I]
    gate_up_rows, down_rows = gate_up.shape[0] // num_experts, down.shape[0] // num_experts
    routed = {e: activations[i, "gate_up", e] for e in range(num_experts)
              if (i, "gate_up", e) in activations}
    if routed:
        # every token counted once per expert it went to, as it runs
        mean_abs = sum(r.sum_abs for r in routed.values()) / sum(r.count for r in routed.values())
        parts = [(slice(e * gate_up_rows, (e + 1) * gate_up_rows), r.rows)
                 for e, r in routed.items()]
        layer.gate_up = _searched(gate_up, mean_abs, parts, spec, report, i, "moe gate_up")
    for e in range(num_experts):
        if (i, "down", e) not in activations:
            report.round_to_nearest.append((i, f"expert {e} down"))
            continue
        inputs = activations[i, "down", e]
        weight = down[e * down_rows:(e + 1) * down_rows]  # [h, I]
        layer.expert_down[e] = _searched(weight, inputs.mean_abs, [(slice(None), inputs.rows)],
                                         spec, report, i, f"expert {e} down")


def _searched(w, mean_abs, parts, spec: QuantizeSpec, report: Report, i: int, group: str
              ) -> torch.Tensor:
    """`_search`'s s, its alpha and errors recorded in the report as (i, group)."""
    try:
        s, alpha, error, rtn = _search(w, mean_abs, parts, spec)
    except ValueError as exc:  # inf / NaN, or a scale past fp16
        raise QuantizeError(f"layer {i}'s {group} weight: {exc}", "model") from None
    report.searches[i, group] = (alpha, error, rtn)
    return s


def _fused_weights(source: Source, arch, index: int) -> dict[str, torch.Tensor]:
    """Layer `index`'s linears as the engine fuses them (q/k/v into qkv; an MoE layer's
    experts stacked: gate_up [E * 2I, h], down [E * h, I]), fp32."""
    prefix = arch.layer_prefix.format(index)
    parts: dict[str, list] = {}
    for name, _, param in arch.layer_tensors(source.cfg):
        if param in QUANTIZED_PARAMS:
            parts.setdefault(param, []).append(source.read(prefix + name).float())
    return {param: torch.cat(p) for param, p in parts.items()}


def fold(source: Source, scales: dict[int, LayerScales]) -> Callable:
    """(name, fp32 tensor) -> the tensor with the scales folded in: s into the scaled
    linears' columns (and an MoE router's), 1/s into the norms and into v's and up's
    rows (and biases). A Gemma norm, applied as (1 + w), becomes (1 + w) / s - 1."""
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
    # an MoE layer: each expert's rows in the stacked gate_up [E * 2I, h] / down [E * h, I]
    expert_rows = {group: used[group + ".weight"] // cfg.num_experts
                   for group in ("gate_up", "down")} if cfg.num_experts else {}
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

    def expert(t, layer: LayerScales, group: str, start: int):
        # expert e's gate / up / down: up's rows take 1/(its down's s), gate / up's
        # columns the shared s, down's columns its own s
        e, row = divmod(start, expert_rows[group])
        down = layer.expert_down.get(e)
        if group == "down":
            return t if down is None else t * down
        if down is not None:
            half = expert_rows[group] // 2
            t = divide_rows(t, row, (half, 2 * half), down)
        return t if layer.gate_up is None else t * layer.gate_up

    def apply(name: str, t: torch.Tensor) -> torch.Tensor:
        if name not in by_name or by_name[name][0] not in scales:
            return t
        i, local, param = by_name[name]
        layer = scales[i]
        group, _, kind = param.partition(".")
        norm_scale = {"input_norm": layer.qkv, mlp_norm: layer.gate_up}.get(param)
        if norm_scale is not None:
            return (1 + t) / norm_scale - 1 if gemma else t / norm_scale
        if param == "router.weight":  # reads the norm's output, as the experts do
            return t if layer.gate_up is None else t * layer.gate_up
        if group in expert_rows:
            return expert(t, layer, group, offsets[local])
        inner = {"qkv": v_rows(layer.o), "gate_up": layer.down}.get(group)
        if inner is not None:
            t = divide_rows(t, offsets[local], fused_rows[group], inner)
        column = getattr(layer, group, None) if kind == "weight" else None
        return t * column if column is not None else t

    return apply
