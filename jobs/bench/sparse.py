"""`fusegen bench --sparsity`: the same model pruned (engine/weights/sparsify.py) and run
sparse beside its dense run, on the same requests (docs/sparsity.md).

Each variant is a sparsity and a values dtype (bf16 or int8 codes with per-tile scales).
Its checkpoint is written once and cached (checkpoint.ensure_sparse_checkpoint). The
figures of a variant come from its run: the bytes each decoder layer's linears hold as
loaded (a sparse linear's components, exactly the codec's `nbytes` of its tiles; a dense
one's weight), the median decode step (decode-only steps, as the engine times them) and
the output rate; under the memory pool also the bytes streamed a step and the stall.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median

# --sparse-values: the name on the command line -> sparsify's --values name
VALUES = {"bfloat16": "bf16", "int8": "int8"}
METHODS = ("magnitude",)  # no calibration: what a benchmark can prune with no data


@dataclass(frozen=True, slots=True)
class SparseVariant:
    sparsity: float  # the share of each row's weights pruned, in (0, 1)
    values: str  # "bfloat16" or "int8"
    method: str = "magnitude"

    @property
    def percent(self) -> str:
        return f"{self.sparsity * 100:g}"

    @property
    def name(self) -> str:
        """The result's key in the report: fusegen_sparse70_bfloat16."""
        return f"fusegen_sparse{self.percent.replace('.', '_')}_{self.values}"

    @property
    def label(self) -> str:
        short = "bf16" if self.values == "bfloat16" else self.values
        return f"fusegen sparse {self.percent}% {short}"


def parse_sparsities(text: str) -> tuple[float, ...]:
    """--sparsity's comma-separated shares, each in (0, 1), ascending, no repeats;
    ValueError naming the one that is not."""
    shares = []
    for item in text.split(","):
        item = item.strip()
        try:
            share = float(item)
        except ValueError:
            raise ValueError(f"--sparsity takes comma-separated shares of weights pruned, "
                             f"each in (0, 1) such as 0.5,0.7,0.8; got {item!r}") from None
        if not 0 < share < 1:  # NaN fails this too
            raise ValueError(f"--sparsity {item} is outside (0, 1): it is the share of each "
                             "row's weights pruned, such as 0.7 for 70%")
        shares.append(share)
    return tuple(sorted(set(shares)))


def variants(sparsities: tuple[float, ...], values: tuple[str, ...],
             method: str) -> list[SparseVariant]:
    """Every (sparsity, values) pair, sparsity ascending, values in the order given."""
    for v in values:
        if v not in VALUES:
            raise ValueError(f"--sparse-values must be bfloat16, int8 or both; got {v!r}")
    if method not in METHODS:
        raise ValueError(f"--sparse-method must be one of {', '.join(METHODS)}; got "
                         f"{method!r}")
    return [SparseVariant(s, v, method) for s in sparsities for v in values]


def linear_bytes_by_layer(model) -> list[int]:
    """Each decoder layer's linears' bytes as the loaded model holds them: a compressed
    linear's components (a sparse one's values + bitmaps + offsets + scales), a dense
    one's weight at its dtype (out x in; packed forms' padding not counted); biases
    left out. A streamed layer is read through the views of its last staging slot,
    which have its own shapes once it has run."""
    from fusegen.engine.weights.linear import Linear
    from fusegen.engine.weights.packed import NativeLinear, PackedLinear

    def held(module) -> int:
        if isinstance(module, (PackedLinear, NativeLinear)):  # padded, or oneDNN's blocks
            return module.out_features * module.in_features * module.weight.element_size()
        bias = module.bias  # nbytes: a compressed linear's components, else its weight
        return module.nbytes - (0 if bias is None else bias.numel() * bias.element_size())

    return [sum(held(m) for m in layer.modules() if isinstance(m, Linear))
            for layer in model.layers]


def summarize(results: dict, chosen: list[SparseVariant]) -> dict:
    """The report's "sparse" entry: for dense and each variant that ran, the bytes per
    decoder layer, the median decode step and the output rate against dense; per values
    dtype the lowest measured sparsity from which on every measured one decodes faster
    than dense (None: none does)."""
    dense = results.get("fusegen", {})
    base = {**_row("fusegen", dense, offloaded=False), "label": _dense_label(dense)}
    offloaded = "offload" in dense
    rows = [base]
    for v in chosen:
        r = results.get(v.name, {})
        if r and "skipped" not in r:
            rows.append({**_row(v.name, r, offloaded), "sparsity": v.sparsity,
                         "values": v.values})
    for row in rows:
        row["bytes_ratio"] = _ratio(row["linear_bytes_per_layer"],
                                    base["linear_bytes_per_layer"])
        # > 1: faster than dense
        row["decode_speedup"] = _ratio(base["decode_step_median_s"],
                                       row["decode_step_median_s"])
        row["throughput_ratio"] = _ratio(row["output_tokens_per_s"],
                                         base["output_tokens_per_s"])
    wins = {values: _wins_from([row for row in rows[1:] if row["values"] == values])
            for values in dict.fromkeys(v.values for v in chosen)}
    return {"method": chosen[0].method if chosen else None, "rows": rows, "wins_from": wins}


def _row(name: str, r: dict, offloaded: bool) -> dict:
    """One run's own figures; `offloaded`: the dense run streamed layers, so this one's
    streaming is told even where it streams nothing (every layer fits its budget)."""
    layers = r.get("linear_bytes_by_layer") or []
    steps = r.get("decode_step_times_s") or []
    row = {"name": name, "label": r.get("label", name),
           "linear_bytes_by_layer": layers,
           "linear_bytes_per_layer": sum(layers) / len(layers) if layers else None,
           "decode_step_median_s": median(steps) if steps else None,
           "output_tokens_per_s": r.get("output_tokens_per_s"),
           "checkpoint": r.get("checkpoint")}
    if "offload" in r or offloaded:
        offload = r.get("offload", {})  # none: no streamer, nothing streamed
        row["offload"] = {"layers": r.get("memory", {}).get("layers"),
                          "streamed_bytes_per_step": offload.get("streamed_bytes_per_step", 0),
                          "stall_per_step_s": offload.get("stall_per_step_s", 0.0)}
    return row


def _dense_label(dense: dict) -> str:
    """The dense run, named with the form its weights ran in where it is not the
    checkpoint's own dense one (a GGUF file's blocks, --quantization int8, ...)."""
    form = dense.get("quantization")
    return "fusegen dense" if form in (None, "dequantize") else f"fusegen dense ({form})"


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _wins_from(rows: list[dict]) -> float | None:
    """The lowest sparsity of `rows` (one values dtype) from which on each row's median
    decode step is shorter than dense's."""
    found = None
    for row in sorted(rows, key=lambda row: row["sparsity"], reverse=True):
        if not (row["decode_speedup"] or 0) > 1:
            break
        found = row["sparsity"]
    return found


def format_sparse(sparse: dict) -> list[str]:
    """The text report's lines of the sparse variants."""
    rows = sparse["rows"]
    lines = ["", f"sparse weights ({sparse['method']} pruning, per output row; decode step: "
             "the median of the decode-only steps; x: against dense)",
             f"{'run':<28}{'linear B/layer':>16}{'x':>7}{'decode ms':>11}{'speedup':>9}"
             f"{'out tok/s':>11}{'x':>7}"]
    offloaded = any("offload" in row for row in rows)
    if offloaded:
        lines[-1] += f"{'resident':>10}{'streamed MB/step':>18}{'stall ms/step':>15}"
    for row in rows:
        step = row["decode_step_median_s"]
        line = (f"{row['label']:<28}{_int(row['linear_bytes_per_layer']):>16}"
                f"{_x(row['bytes_ratio']):>7}{_ms(step):>11}{_x(row['decode_speedup']):>9}"
                f"{_num(row['output_tokens_per_s']):>11}{_x(row['throughput_ratio']):>7}")
        offload = row.get("offload")
        if offload:
            layers = offload["layers"]
            resident = f"{layers['device']}/{sum(layers.values())}"
            line += (f"{resident:>10}"
                     f"{offload['streamed_bytes_per_step'] / 1e6:>18,.1f}"
                     f"{offload['stall_per_step_s'] * 1e3:>15.2f}")
        lines.append(line)
    for values, share in sparse["wins_from"].items():
        short = "bf16" if values == "bfloat16" else values
        lines.append(f"sparse {short} values decode faster than dense "
                     + (f"from {share * 100:g}% sparsity on (of those measured)"
                        if share is not None else "at none of the sparsities measured"))
    return lines


def _int(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def _num(value) -> str:
    return "-" if value is None else f"{value:,.1f}"
