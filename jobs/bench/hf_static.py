"""Baseline 1: Hugging Face transformers `generate` over static batches.

What most people run today: requests in fixed batches, left-padded to the batch's longest
prompt, each batch generating until its largest budget. Only each request's own budget
counts as useful output; the rest is padding and overrun that the wall time still pays."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from fusegen.jobs.bench.results import EngineResult
from fusegen.jobs.bench.workload import BenchRequest

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(model_dir: Path, dtype: str, device: str, gguf_file: str | None = None):
    """`gguf_file`: a GGUF file in model_dir, read by transformers' own GGUF loader."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the benchmark prints its own progress lines
    gguf = {} if gguf_file is None else {"gguf_file": gguf_file}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=TORCH_DTYPES[dtype],
                                                 **gguf)
    return model.to(device).eval()


def batch_inputs(requests: list[BenchRequest], pad_id: int, device: str):
    """Left padding: every prompt ends at the last column, where generation starts."""
    width = max(r.num_prompt_tokens for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, r in enumerate(requests):
        ids[row, width - r.num_prompt_tokens:] = torch.tensor(r.prompt_ids, dtype=torch.long)
        mask[row, width - r.num_prompt_tokens:] = 1
    return ids.to(device), mask.to(device)  # [B, width] each


def _generate(model, requests: list[BenchRequest], device: str) -> int:
    """One static batch; returns the tokens generated per row."""
    from transformers import GenerationConfig

    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids, mask = batch_inputs(requests, pad_id, device)
    new = max(r.max_tokens for r in requests)
    # min_new_tokens = max_new_tokens masks EOS out: the random model runs the whole budget.
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=pad_id, eos_token_id=model.config.eos_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)  # the timed batch ends when the GPU is done
    return out.shape[1] - ids.shape[1]


def run_hf_static(model, requests: list[BenchRequest], warmup: list[BenchRequest], *,
                  batch_size: int, device: str, progress: Callable[[str], None]) -> EngineResult:
    result = EngineResult("hf_static", f"hf generate, static bs {batch_size}")
    _generate(model, warmup, device)  # untimed
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    generated_rows = padded_prompt = 0
    budgets_met = True
    for index, batch in enumerate(batches):
        start = time.perf_counter()
        generated = _generate(model, batch, device)
        result.elapsed_s += time.perf_counter() - start
        budgets_met &= generated == max(r.max_tokens for r in batch)
        result.counts += [(r.num_prompt_tokens, min(generated, r.max_tokens)) for r in batch]
        generated_rows += generated * len(batch)
        padded_prompt += max(r.num_prompt_tokens for r in batch) * len(batch)
        progress(f"hf static: batch {index + 1}/{len(batches)} done "
                 f"({len(batch)} requests, {generated} new tokens each, "
                 f"{result.elapsed_s:.1f}s so far)")
    result.budgets_met = budgets_met
    useful = result.num_output_tokens
    result.extra = {
        "batch_size": batch_size,
        "num_generated_tokens": generated_rows,  # useful + generated past a request's budget
        "num_padded_prompt_tokens": padded_prompt,  # prompt positions incl. left padding
        "wasted_output_fraction": 1 - useful / generated_rows if generated_rows else 0.0,
    }
    return result
