"""Cooperative KV placement against today's swapping and recompute, on one long-context
workload in one process (docs/performance.md has the figures):

    python -m fusegen.jobs.bench.cooperative_kv [--device cuda] [--num-requests 4]
        [--prompt-min 8192] [--prompt-max 32768] [--max-tokens 32] [--rounds 2]
        [--warmup 1] [--placements swap,recompute,cooperative]

A random tiny-width Llama (2 layers, hidden 128, 4 query heads and 2 KV heads of 32, fp32)
takes `num-requests` prompts of random ids, lengths spread evenly from prompt-min to
prompt-max, each generating max-tokens greedily. The device KV pool is the least that
holds one request of max_model_len, below what the batch needs; the same engines run the
same requests in turn, `rounds` times (prefix caching off, so no round reuses another's
blocks), after `warmup` rounds of one short request each (kernel compilation on a GPU):
  - swap: kv_placement="device" with a host pool preempted requests are swapped to;
  - recompute: kv_placement="device" with no host pool (preempted requests start over);
  - cooperative: each request's first blocks on the device, the rest in the host pool,
    whose attention runs on the host's cores (beside a GPU: while the GPU computes the
    device part).
Prints, per placement, the median seconds, output and total tokens/s, the mean batch of
its decode steps (the batch it sustains), preemptions, swapped blocks, the bytes that
crossed between device and host memory (swap: every swapped block out and back in;
cooperative: queries, the host rows' new keys and values, the host part's outputs) and
cooperative's stall per step (the time the device waited on host parts).
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

BLOCK = 16
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
BLOCK_BYTES = LAYERS * BLOCK * 2 * KV_HEADS * HEAD_DIM * 4  # keys and values, fp32
PLACEMENTS = ("swap", "recompute", "cooperative")


@dataclass(slots=True)
class Run:
    """One placement's round."""
    seconds: float
    decode_batch: float
    preempted: int
    swapped_blocks: int
    crossed_bytes: int  # between device and host memory
    steps: int
    stall_seconds: float  # cooperative: the device's wait on host parts


def _engines(path: str, device: str, max_model_len: int, num_requests: int,
             host_blocks: int, placements: list[str]) -> dict:
    from fusegen.engine import LLM

    device_blocks = -(-max_model_len // BLOCK)
    common = dict(dtype="float32", max_model_len=max_model_len, max_num_seqs=num_requests,
                  num_kv_blocks=device_blocks, enable_prefix_caching=False, block_size=BLOCK,
                  device=device)
    host = dict(num_host_kv_blocks=host_blocks, host_memory=f"{host_blocks * 2}MiB")
    options = {"swap": dict(kv_placement="device", **host),
               "recompute": dict(kv_placement="device", num_host_kv_blocks=0),
               "cooperative": dict(kv_placement="cooperative", **host)}
    return {name: LLM(path, **options[name], **common) for name in placements}


def _run(name: str, llm, prompts, params) -> tuple[Run, list[list[int]]]:
    from fusegen.engine.cooperative import recording

    before = llm.stats()
    with recording() as coop:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    after = llm.stats()
    decode_steps = after["num_decode_steps"] - before["num_decode_steps"]
    batch = (after["mean_decode_batch"] * after["num_decode_steps"]
             - before["mean_decode_batch"] * before["num_decode_steps"])
    swapped = after["num_swapped_blocks"] - before["num_swapped_blocks"]
    run = Run(seconds, batch / max(decode_steps, 1),
              after["num_preemptions"] - before["num_preemptions"], swapped,
              2 * swapped * BLOCK_BYTES + coop.bytes_to_host + coop.bytes_to_device,
              after["num_steps"] - before["num_steps"], coop.stall_seconds)
    return run, [o.token_ids for o in outs]


def run_benchmark(args) -> tuple[dict[str, list[Run]], bool]:
    """Each placement's runs and whether all gave the same greedy tokens; prints as it
    goes."""
    from fusegen.engine import SamplingParams
    from fusegen.engine.models.synthetic import build_checkpoint

    max_model_len = -(-(args.prompt_max + args.max_tokens) // BLOCK) * BLOCK
    path = build_checkpoint(tempfile.mkdtemp(prefix="fusegen-coop-"), hidden_size=128,
                            intermediate_size=256, num_layers=LAYERS, num_heads=4,
                            num_kv_heads=KV_HEADS, max_position_embeddings=max_model_len, seed=3)
    rng = random.Random(0)
    step = (args.prompt_max - args.prompt_min) // max(args.num_requests - 1, 1)
    lengths = [args.prompt_min + i * step for i in range(args.num_requests)]
    prompts = [{"prompt_token_ids": [rng.randrange(3, 400) for _ in range(n)]} for n in lengths]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    need = sum(-(-(n + args.max_tokens) // BLOCK) for n in lengths)
    device_blocks = -(-max_model_len // BLOCK)
    engines = _engines(str(path), args.device, max_model_len, args.num_requests, need,
                       args.placements)
    print(f"prompts {lengths} tokens, {args.max_tokens} generated each; KV blocks of {BLOCK}: "
          f"the batch needs {need}, the device holds {device_blocks}", flush=True)
    # a request past its device quota: cooperative steps (and every kernel) run once
    quota = max(1, device_blocks // args.num_requests)
    warm = [{"prompt_token_ids": [rng.randrange(3, 400)
                                  for _ in range(min((quota + 2) * BLOCK, args.prompt_max))]}]
    for _ in range(args.warmup):
        for llm in engines.values():
            llm.generate(warm, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
    runs = {name: [] for name in engines}
    tokens = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            run, tokens[name] = _run(name, llm, prompts, params)
            runs[name].append(run)
            print(f"  {name}: {run.seconds:.1f} s, decode batch {run.decode_batch:.2f}, "
                  f"{run.preempted} preempted, {run.swapped_blocks} blocks swapped, "
                  f"{run.crossed_bytes / 2**20:.1f} MiB crossed", flush=True)
    for llm in engines.values():
        llm.close()
    _print_table(runs, args.num_requests * args.max_tokens,
                 args.num_requests * args.max_tokens + sum(lengths), args.rounds)
    same = all(t == next(iter(tokens.values())) for t in tokens.values())
    print(f"greedy tokens identical across placements: {same}")
    return runs, same


def _print_table(runs: dict[str, list[Run]], generated: int, total: int, rounds: int) -> None:
    print(f"{'placement':<12} {'seconds':>8} {'out tok/s':>9} {'tok/s':>8} {'decode batch':>12} "
          f"{'preempted':>9} {'swapped':>8} {'MiB crossed':>11} {'stall ms/step':>13}"
          f"   (medians of {rounds})")
    med = (lambda rows, f: statistics.median(f(r) for r in rows))
    for name, rows in runs.items():
        seconds = med(rows, lambda r: r.seconds)
        stall = ("-" if name != "cooperative" else
                 f"{med(rows, lambda r: 1e3 * r.stall_seconds / max(r.steps, 1)):.2f}")
        print(f"{name:<12} {seconds:8.1f} {generated / seconds:9.2f} {total / seconds:8.0f} "
              f"{med(rows, lambda r: r.decode_batch):12.2f} "
              f"{med(rows, lambda r: r.preempted):9.0f} "
              f"{med(rows, lambda r: r.swapped_blocks):8.0f} "
              f"{med(rows, lambda r: r.crossed_bytes) / 2**20:11.1f} {stall:>13}")
    if "swap" in runs and "cooperative" in runs:
        saved = (med(runs["swap"], lambda r: r.crossed_bytes)
                 - med(runs["cooperative"], lambda r: r.crossed_bytes))
        print(f"bytes between device and host saved by cooperative against swap: "
              f"{saved / 2**20:.1f} MiB a round")


def _placements(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PLACEMENTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"--placements: {', '.join(bad) or 'none given'}; choose from {', '.join(PLACEMENTS)}")
    return names


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--prompt-min", type=int, default=8192)
    parser.add_argument("--prompt-max", type=int, default=32768)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1,
                        help="rounds of one short request per engine first, not counted")
    parser.add_argument("--placements", type=_placements, default=list(PLACEMENTS),
                        help="comma-separated: swap, recompute, cooperative")
    args = parser.parse_args(argv)
    for name in ("num_requests", "prompt_min", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, name)}")
    if args.prompt_max < args.prompt_min:
        parser.error(f"--prompt-max {args.prompt_max} is below --prompt-min {args.prompt_min}")
    return args


def main(argv=None) -> None:
    run_benchmark(parse_args(argv))


if __name__ == "__main__":
    main()
