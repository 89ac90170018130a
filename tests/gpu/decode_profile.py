"""Where a GPU decode step's time goes (../shared/GPU.md, item 3): decode throughput at
batch 64 and 256, eagerly and with recorded decode steps (CUDA graphs), then
torch.profiler over 128 requests' 32 decode steps in each mode, on the bench's cached
checkpoint. usage: python3 tests/gpu/decode_profile.py CHECKPOINT_DIR OUT_DIR
(Not named profile.py: that would shadow the standard library's module.)"""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from fusegen.engine import LLM, SamplingParams

ckpt, out = sys.argv[1], sys.argv[2]
params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def busy(prof) -> dict:
    """How busy the GPU was over the profiled window: the union of kernel intervals
    against the window from the first kernel's start to the last one's end. The rest is
    the GPU waiting for the host (launches, Python, syncs)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    total += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    calls = {}
    for e in prof.events():
        if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                      "cudaStreamSynchronize", "cudaMemcpyAsync", "cudaDeviceSynchronize"):
            calls[e.name] = calls.get(e.name, 0) + 1
    return {"kernels": len(spans), "window_ms": window / 1e3, "gpu_busy_ms": total / 1e3,
            "busy_fraction": total / window, "host_calls": calls}


res, tokens = {}, {}
for eager in (True, False):
    mode = "eager" if eager else "graphs"
    g = torch.Generator().manual_seed(0)
    prompts = lambda n, length: [torch.randint(100, 30000, (length,), generator=g).tolist()
                                 for _ in range(n)]
    llm = LLM(ckpt, dtype="bfloat16", device="cuda", enforce_eager=eager)
    llm.generate(prompts(8, 64), params(8), use_tqdm=False)  # warm
    for batch in (64, 256):
        ps = prompts(batch, 200)
        llm.generate(ps[:batch], params(3), use_tqdm=False)  # record/compile this batch's shapes
        s0 = llm.stats(); t = time.perf_counter()
        outs = llm.generate(ps, params(129), use_tqdm=False)
        torch.cuda.synchronize(); el = time.perf_counter() - t; s1 = llm.stats()
        steps = s1["num_steps"] - s0["num_steps"]
        dsteps = s1["num_decode_steps"] - s0["num_decode_steps"]
        dsec = s1["decode_seconds"] - s0["decode_seconds"]
        res[f"{mode}_{batch}"] = {"elapsed_s": el, "out_tok_s": batch * 129 / el, "steps": steps,
                                  "decode_step_ms": 1e3 * dsec / max(dsteps, 1)}
        tokens[(mode, batch)] = [o.token_ids for o in outs]
        print(mode, "batch", batch, res[f"{mode}_{batch}"], flush=True)
    llm.generate(prompts(128, 200), params(3), use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(128, 200), params(33), use_tqdm=False)
        torch.cuda.synchronize()
    try:
        res[f"{mode}_profile"] = busy(prof)
        print(mode, "gpu busy", res[f"{mode}_profile"], flush=True)
    except Exception as failure:  # the figures above still come back
        print(mode, "gpu busy: not computed:", repr(failure), flush=True)
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=25)
    cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=20)
    with open(f"{out}/profile.txt", "a") as file:  # one file: a call brings back 8
        file.write(f"== {mode}\n{table}\n\n{cpu_table}\n\n")
    llm.close()
    del llm
    torch.cuda.empty_cache()
# The same prompts (one seed) eagerly and from graphs: bf16 tokens can part where a
# padded batch picks another GEMM kernel; how many sequences agree, and from where.
for batch in (64, 256):
    a, b = tokens[("eager", batch)], tokens[("graphs", batch)]
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]
    res[f"agree_{batch}"] = {"identical": sum(f is None for f in first), "of": len(a),
                             "first_difference": sorted(f for f in first if f is not None)[:10]}
    print("eager vs graphs, batch", batch, res[f"agree_{batch}"], flush=True)
json.dump(res, open(f"{out}/decode.json", "w"), indent=1)
