"""`fusegen sparsify`: a checkpoint pruned per output row (magnitude or Wanda) and
written in fusegen's sparse format (docs/sparsify.md). The calibration prompts are read
as `fusegen quantize` reads them (jobs/quantize_cmd.py); the engine does the rest
(engine/weights/sparsify.py)."""
from __future__ import annotations

import re

import click

from fusegen.jobs.quantize_cmd import (calibration_options, calibration_prompts,
                                       output_options, stopped_by_signals)


@click.command()
@click.option("--model", "model", required=True,
              help="Source: a 16-bit or fp32 checkpoint directory (config.json, "
              "*.safetensors, tokenizer) or a .gguf file (dequantized as it is read; "
              "written in bf16), of any architecture fusegen runs.")
@click.option("--sparsity", type=float, required=True,
              help="Fraction of each output row's weights pruned, in (0, 1): a row of n "
              "keeps round((1 - sparsity) * n), a half rounded to even.")
@click.option("--method", type=click.Choice(["magnitude", "wanda"]), default="magnitude",
              show_default=True, help="magnitude: keep the largest |w| of each row; wanda: "
              "the largest |w| * ||x||, x the layer's inputs on --calibration prompts.")
@calibration_options("wanda")
@click.option("--values", type=click.Choice(["bf16", "fp16", "fp32", "int8"]),
              help="The kept weights' dtype (int8: with one scale a 64 x 64 tile); by "
              "default the source's (a GGUF file's: bf16).")
@output_options
def sparsify(model, sparsity, method, calibration, calibration_column, calibration_rows,
             values, output, overwrite):
    """Write a pruned copy of a checkpoint: every decoder-layer linear keeps the same
    number of weights in each output row, stored as sparse tiles; embeddings, head,
    norms and MoE routers stay dense."""
    from fusegen.engine.weights.sparsify import SparsifySpec, sparsify_checkpoint
    from fusegen.engine.weights.quantize import QuantizeError

    try:
        spec = SparsifySpec(sparsity, method, values)
        prompts = calibration_prompts(method, "wanda", calibration, calibration_column,
                                      calibration_rows)
        with stopped_by_signals(output):
            report = sparsify_checkpoint(model, output, spec, prompts=prompts,
                                         overwrite=overwrite)
    except QuantizeError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'--{exc.option}'") from None
    for line in report_lines(report):
        click.echo(line)
    click.echo(f"wrote {output}")


def report_lines(report) -> list[str]:
    """Per decoder layer and in total: the linears' bytes dense (the source's dtype)
    against sparse (values + bitmaps + offsets + scales, exactly), and what was done."""
    layers: dict[str, list[int]] = {}
    for name, (dense, sparse) in report.layers.items():
        match = re.search(r"\.layers\.(\d+)\.", name)
        key = f"layer {match.group(1)}" if match else name
        total = layers.setdefault(key, [0, 0, 0])
        total[0], total[1], total[2] = total[0] + dense, total[1] + sparse, total[2] + 1
    lines = [f"{key}: {count} linears, {dense} B dense -> {sparse} B sparse "
             f"({_ratio(sparse, dense)})" for key, (dense, sparse, count) in
             sorted(layers.items(), key=lambda item: _layer_order(item[0]))]
    lines.insert(0, f"bytes of the decoder linears, dense ({report.dense_dtype}) against "
                 f"sparse ({report.values} values, bitmaps, offsets"
                 f"{', scales' if report.values == 'int8' else ''}):")
    dense = sum(d for d, _ in report.layers.values())
    sparse = sum(s for _, s in report.layers.values())
    lines.append(f"total: {len(report.layers)} linears, {dense} B dense -> {sparse} B sparse "
                 f"({_ratio(sparse, dense)})")
    lines += [f"wanda {name}: no calibration tokens routed to this expert, pruned by "
              "magnitude" for name in report.by_magnitude]
    lines.append(f"sparsified {report.num_quantized} tensors; copied {report.num_copied}; "
                 f"weight files {report.bytes_before} B -> {report.bytes_after} B in "
                 f"{report.num_files} file(s)")
    return lines


def _layer_order(key: str):
    return (0, int(key.split()[1]), "") if key.startswith("layer ") else (1, 0, key)


def _ratio(sparse: int, dense: int) -> str:
    return f"{sparse / dense:.3f}x" if dense else "-"
