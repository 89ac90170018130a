"""Where a GPU decode step's time goes (../shared/GPU.md, item 3): decode throughput at
batch 64 and 256, then torch.profiler over 128 requests' 32 decode steps, on the bench's
cached checkpoint. usage: python3 tests/gpu/decode_profile.py CHECKPOINT_DIR OUT_DIR
(Not named profile.py: that would shadow the standard library's module.)"""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from fusegen.engine import LLM, SamplingParams

ckpt, out = sys.argv[1], sys.argv[2]
llm = LLM(ckpt, dtype="bfloat16", device="cuda")
g = torch.Generator().manual_seed(0)
def prompts(n, length):
    return [torch.randint(100, 30000, (length,), generator=g).tolist() for _ in range(n)]
params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
llm.generate(prompts(8, 64), params(8), use_tqdm=False)  # warm
res = {}
for batch in (64, 256):
    ps = prompts(batch, 200)
    s0 = llm.stats(); t = time.perf_counter()
    llm.generate(ps, params(129), use_tqdm=False)
    torch.cuda.synchronize(); el = time.perf_counter() - t; s1 = llm.stats()
    res[batch] = {"elapsed_s": el, "out_tok_s": batch * 129 / el,
                  "steps": s1["num_steps"] - s0["num_steps"]}
    print("batch", batch, res[batch], flush=True)
ps = prompts(128, 200)
llm.generate(ps, params(1), use_tqdm=False)  # every shape of the window seen once
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(prompts(128, 200), params(33), use_tqdm=False)
    torch.cuda.synchronize()
table = prof.key_averages().table(sort_by="device_time_total", row_limit=30)
print(table)
cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
print(cpu_table)
open(f"{out}/profile.txt", "w").write(table + "\n\n" + cpu_table)
json.dump(res, open(f"{out}/decode.json", "w"), indent=1)
llm.close()
