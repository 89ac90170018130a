"""The engine's GPU path on CPU: every kernel through Triton (in its interpreter)
inside a real generation, token-identical to the reference path and transformers."""
from checkpoints import hf_greedy
from quant_helpers import run_interpreted

SCRIPT = """
import json, sys
from fusegen.kernels.testing import backport_interpreter_fixes
backport_interpreter_fixes()
from fusegen.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_num_batched_tokens=24, block_size=4)
prompts = [[5, 9, 100, 7, 42, 17, 3, 250, 11, 12, 13], [300], list(range(30, 60))]
outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
print(json.dumps([prompts, [o.token_ids for o in outs]]))
llm.close()
"""


def test_engine_through_triton_interpreter(llama_dir):
    prompts, outputs = run_interpreted(SCRIPT, str(llama_dir))
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == hf_greedy(llama_dir, prompt, 5)
