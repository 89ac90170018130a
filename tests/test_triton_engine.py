"""The engine's GPU path on CPU: every kernel through Triton (in its interpreter)
inside a real generation, token-identical to the reference path and transformers."""
import json
import os
import subprocess
import sys
from pathlib import Path

from checkpoints import hf_greedy

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
    env = {**os.environ, "TRITON_INTERPRET": "1", "FUSEGEN_KERNELS": "triton",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(llama_dir)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    prompts, outputs = json.loads(done.stdout.strip().splitlines()[-1])
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == hf_greedy(llama_dir, prompt, 5)
