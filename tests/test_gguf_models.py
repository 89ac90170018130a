"""Real weights from GGUF files: SmolLM2-135M-Instruct (Q4_1 / Q8_0, llama) and Gemma 3
270M (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0; gemma3), greedy and in fp32, token for token
equal to transformers' own GGUF loader (`from_pretrained(dir, gguf_file=name)`), the
prompts fused into one batch here and run one at a time there."""
import dataclasses

import pytest
import torch

from gguf_checkpoints import gemma3_path, smollm2_path
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.weights.gguf import gguf_model_config

transformers = pytest.importorskip("transformers", reason="transformers is the reference "
                                   "(pip install transformers)")

MAX_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three colours, one per line.", "Translate 'good morning' into Spanish.",
             "Explain in one sentence why the sky is blue."]
OPTIONS = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=8)


def _reference_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _check_against(path, prompts_of, num_prompts: int = len(QUESTIONS)):
    """fusegen's fused greedy batch == transformers' greedy `generate` prompt by prompt;
    the config read from the metadata == transformers' config."""
    model = _reference_model(path)
    with LLM(str(path), **OPTIONS) as llm:
        prompts = [llm.tokenizer.encode(p, add_special_tokens=False)
                   for p in prompts_of(llm)[:num_prompts]]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params)
        assert llm.stats()["num_steps"] == MAX_TOKENS  # every prompt prefilled in one step
    for ids, out in zip(prompts, outs):
        want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                              dtype=torch.long), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == want, out.text
    raw = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    theirs = ModelConfig.from_dict(raw, source="transformers")
    assert dataclasses.replace(theirs, torch_dtype=None) == gguf_model_config(path)
    return outs


def test_smollm2_chat_equals_transformers():
    path = smollm2_path()

    def chat_prompts(llm):
        return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
                for q in QUESTIONS]

    outs = _check_against(path, chat_prompts)
    assert outs[0].text.startswith("The capital of France is Paris.")


def test_gemma3_equals_transformers():
    path = gemma3_path()

    def turn_prompts(llm):
        # The file embeds no chat template: Gemma's turn format, written out, after BOS.
        return [f"<bos><start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n"
                for q in QUESTIONS]

    _check_against(path, turn_prompts, num_prompts=3)  # its 262k-row head: slow there
