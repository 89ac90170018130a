"""Cooperative KV placement against today's swapping and recompute, on one long-context
workload in one process (docs/performance.md has the figures):

    python -m fusegen.jobs.bench.cooperative_kv [--num-requests 4] [--prompt-min 8192]
        [--prompt-max 32768] [--max-tokens 32] [--rounds 2]

A random tiny-width Llama (2 layers, hidden 128, 4 query heads and 2 KV heads of 32, fp32)
takes `num-requests` prompts of random ids, lengths spread evenly from prompt-min to
prompt-max, each generating max-tokens greedily. The device KV pool is the least that
holds one request of max_model_len (what the plan allows), below what the batch needs;
the same engines run the same requests in turn, `rounds` times (prefix caching off, so
no round reuses another's blocks):
  - swap: kv_placement="device" with a host pool preempted requests are swapped to;
  - recompute: kv_placement="device" with no host pool (preempted requests start over);
  - cooperative: each request's first blocks on the device, the rest in the host pool.
Prints, per placement, the median seconds, output and total tokens/s, the mean batch of
its decode steps (the batch it sustains), preemptions and swapped blocks.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

BLOCK = 16


def _engines(path: str, max_model_len: int, num_requests: int, host_blocks: int) -> dict:
    from fusegen.engine import LLM

    device_blocks = -(-max_model_len // BLOCK)
    common = dict(dtype="float32", max_model_len=max_model_len, max_num_seqs=num_requests,
                  num_kv_blocks=device_blocks, enable_prefix_caching=False, block_size=BLOCK)
    host = dict(num_host_kv_blocks=host_blocks, host_memory=f"{host_blocks * 2}MiB")
    return {"swap": LLM(path, kv_placement="device", **host, **common),
            "recompute": LLM(path, kv_placement="device", num_host_kv_blocks=0, **common),
            "cooperative": LLM(path, kv_placement="cooperative", **host, **common)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--prompt-min", type=int, default=8192)
    parser.add_argument("--prompt-max", type=int, default=32768)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    from fusegen.engine import SamplingParams
    from fusegen.engine.models.synthetic import build_checkpoint

    max_model_len = -(-(args.prompt_max + args.max_tokens) // BLOCK) * BLOCK
    path = build_checkpoint(tempfile.mkdtemp(prefix="fusegen-coop-"), hidden_size=128,
                            intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                            max_position_embeddings=max_model_len, seed=3)
    rng = random.Random(0)
    step = (args.prompt_max - args.prompt_min) // max(args.num_requests - 1, 1)
    lengths = [args.prompt_min + i * step for i in range(args.num_requests)]
    prompts = [{"prompt_token_ids": [rng.randrange(3, 400) for _ in range(n)]} for n in lengths]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    need = sum(-(-(n + args.max_tokens) // BLOCK) for n in lengths)
    engines = _engines(str(path), max_model_len, args.num_requests, host_blocks=need)
    print(f"prompts {lengths} tokens, {args.max_tokens} generated each; KV blocks of {BLOCK}: "
          f"the batch needs {need}, the device holds {-(-max_model_len // BLOCK)}", flush=True)
    runs = {name: [] for name in engines}
    tokens = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            before = llm.stats()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = llm.stats()
            decode_steps = after["num_decode_steps"] - before["num_decode_steps"]
            batch = (after["mean_decode_batch"] * after["num_decode_steps"]
                     - before["mean_decode_batch"] * before["num_decode_steps"])
            runs[name].append((seconds, batch / max(decode_steps, 1),
                               after["num_preemptions"] - before["num_preemptions"],
                               after["num_swapped_blocks"] - before["num_swapped_blocks"]))
            tokens[name] = [o.token_ids for o in outs]
            print(f"  {name}: {seconds:.1f} s, decode batch {runs[name][-1][1]:.2f}, "
                  f"{runs[name][-1][2]} preempted, {runs[name][-1][3]} blocks swapped",
                  flush=True)
    generated = args.num_requests * args.max_tokens
    total = generated + sum(lengths)
    print(f"{'placement':<12} {'seconds':>8} {'out tok/s':>9} {'tok/s':>8} {'decode batch':>12} "
          f"{'preempted':>9} {'swapped':>8}   (medians of {args.rounds})")
    for name, rows in runs.items():
        seconds = statistics.median(r[0] for r in rows)
        print(f"{name:<12} {seconds:8.1f} {generated / seconds:9.2f} {total / seconds:8.0f} "
              f"{statistics.median(r[1] for r in rows):12.2f} "
              f"{statistics.median(r[2] for r in rows):9.0f} "
              f"{statistics.median(r[3] for r in rows):8.0f}")
    same = all(t == tokens["swap"] for t in tokens.values())
    print(f"greedy tokens identical across placements: {same}")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
