"""`fusegen quantize`: a checkpoint (or GGUF file) written as fusegen's group-quantized
int8 / int4 checkpoint (docs/quantization.md)."""
from __future__ import annotations

import click


@click.command()
def quantize():
    """Write a group-quantized int8 / int4 copy of a checkpoint (in progress)."""
    raise click.UsageError("fusegen quantize is not finished yet")
