"""What scripts written against vLLM's offline API use: `n` completions per prompt in
`RequestOutput.outputs`, `sampling_params=` (one or a list), `use_tqdm`, `LLM.chat`'s
keywords, and `LLM(...)`'s engine options: vLLM's names read as fusegen's, the ones
fusegen does not have refused with the reason."""
import json
import shutil
import time

import pytest

from checkpoints import hf_greedy
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.errors import EngineConfigError, ModelLoadError
from fusegen.engine.options import NAMES, VLLM_NAMES, EngineOptions
from fusegen.engine.tokenizer import Tokenizer

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(str(llama_dir), dtype="float32") as engine:
        yield engine


def greedy(max_tokens=8, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_n_greedy_completions_equal_transformers(llm, llama_dir):
    (out,) = llm.generate(PROMPTS[1], greedy(n=3), use_tqdm=False)
    want = hf_greedy(llama_dir, llm.tokenizer.encode(PROMPTS[1]), 8)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [want] * 3
    assert [c.finish_reason for c in out.outputs] == ["length"] * 3
    assert len({c.text for c in out.outputs}) == 1 and out.text == out.outputs[0].text
    assert out.num_generated_tokens == 24 and out.token_ids == want
    assert llm.engine.scheduler.num_unfinished == 0


def test_n_seeded_completions_equal_single_requests_seeded_seed_plus_i(llm):
    def sampled(seed, n=1):
        return SamplingParams(n=n, max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)

    (out,) = llm.generate(PROMPTS[0], sampled(7, n=3), use_tqdm=False)
    singles = llm.generate([PROMPTS[0]] * 3, [sampled(7), sampled(8), sampled(9)],
                           use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    assert [c.text for c in out.outputs] == [s.text for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # three different draws


def test_request_output_fields_and_properties(llm):
    prompt = "A prompt no other test sends, for its output fields."
    ids = llm.tokenizer.encode(prompt)
    full = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    stop_id = full.token_ids[3]
    first_stop = full.token_ids.index(stop_id)
    out = llm.generate(prompt, greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert (out.prompt, out.prompt_token_ids, out.num_prompt_tokens) == (prompt, ids, len(ids))
    assert (out.finished, out.error, out.error_code, out.prompt_logprobs) == (True, None, None,
                                                                             None)
    (c,) = out.outputs
    assert (c.index, c.finish_reason, c.stop_reason) == (0, "stop", stop_id)
    assert c.token_ids == full.token_ids[:first_stop + 1] and c.finished()
    assert (c.cumulative_logprob, c.logprobs, c.structured_valid) == (None, None, None)
    assert full.outputs[0].stop_reason is None  # length
    # a stop string: stop_reason is the string (the earliest match in the text wins)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cut = llm.generate(prompt, greedy(stop=["never in the text \u2603", stop]),
                       use_tqdm=False)[0].outputs[0]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.text == full.text[:full.text.index(stop)]
    by_ids, by_dict = llm.generate([ids, {"prompt_token_ids": ids}], greedy(), use_tqdm=False)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_ids.token_ids == by_dict.token_ids == full.token_ids
    assert llm.generate({"prompt": prompt}, greedy(), use_tqdm=False)[0].prompt == prompt


def test_completions_carry_logprobs_with_each_tokens_text(llm):
    params = greedy(4, n=2, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 4
        assert all(t in lp and 2 <= len(lp) <= 3 for t, lp in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(
            sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)), abs=1e-5)
        assert all(p.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
                   for lp in c.logprobs for t, p in lp.items())
    assert out.outputs[0].logprobs == out.outputs[1].logprobs  # greedy: the same draws
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == out.num_prompt_tokens
    assert all(p.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
               for lp in out.prompt_logprobs[1:] for t, p in lp.items())


@pytest.mark.parametrize("caching", [True, False])
def test_num_cached_tokens_and_enable_prefix_caching(llama_dir, caching):
    prompt = "The same long instruction, sent twice over. " * 4
    with LLM(str(llama_dir), dtype="float32", enable_prefix_caching=caching) as llm:
        first, again = (llm.generate(prompt, greedy(4), use_tqdm=False)[0] for _ in range(2))
    # Every full 16-token block but the one holding the last prompt token is reused.
    cached = (first.num_prompt_tokens - 1) // 16 * 16 if caching else 0
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, cached)
    assert cached >= 64 or not caching  # the prompt spans several blocks
    assert again.token_ids == first.token_ids


def test_a_bad_prompt_fails_once_whatever_its_n(llm):
    bad_params, bad_dict = llm.generate(
        [PROMPTS[0], {"text": "x"}], [greedy(n=3, top_p=0.0), greedy(n=3)], use_tqdm=False)
    assert bad_params.error == "invalid_params: top_p must be in (0, 1], got 0.0"
    assert bad_params.error_code == "invalid_params"
    assert bad_params.prompt == PROMPTS[0]
    assert bad_params.prompt_token_ids == llm.tokenizer.encode(PROMPTS[0])
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in bad_params.outputs] == \
        [(0, "", [], "error")]
    assert bad_dict.error == ('invalid_prompt: a prompt must be a string, a list of token '
                              'ids, or a dict with "prompt" or "prompt_token_ids", got a dict '
                              "with keys ['text']")
    assert bad_dict.num_generated_tokens == 0 and bad_dict.finish_reason == "error"
    (zero,) = llm.generate(PROMPTS[0], greedy(n=0), use_tqdm=False)
    assert zero.error == "invalid_params: n must be an integer >= 1, got 0"


def test_sampling_params_keyword_one_or_one_per_prompt(llm):
    outs = llm.generate(PROMPTS, sampling_params=[greedy(3), greedy(5, n=2)], use_tqdm=False)
    assert [[len(c.token_ids) for c in o.outputs] for o in outs] == [[3], [5, 5]]
    same = llm.generate(PROMPTS, sampling_params=greedy(5), use_tqdm=False)
    assert same[0].token_ids[:3] == outs[0].token_ids
    assert same[1].token_ids == outs[1].outputs[1].token_ids
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(5), False)] == \
        [o.token_ids for o in same]  # fusegen's positional form
    with pytest.raises(ValueError, match=r"^2 prompts but 1 SamplingParams; pass one "
                                         r"SamplingParams for all, or one per prompt$"):
        llm.generate(PROMPTS, sampling_params=[greedy()])


def test_use_tqdm_draws_a_bar_on_stderr_only_when_asked(llm, capsys):
    llm.generate(PROMPTS, greedy(), use_tqdm=True)
    captured = capsys.readouterr()
    assert "Processed prompts: 100%" in captured.err and "2/2" in captured.err
    assert "output: " in captured.err and captured.out == ""
    llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert capsys.readouterr() == ("", "")


def test_chat_takes_generate_keywords(llm, capsys):
    conversation = [{"role": "user", "content": "Where is the station?"}]
    ids = llm.tokenizer.encode_chat(conversation)
    (out,) = llm.chat(conversation, sampling_params=greedy(n=2), use_tqdm=False)
    want = llm.generate(ids, greedy(), use_tqdm=False)[0].token_ids
    assert [c.token_ids for c in out.outputs] == [want, want]
    assert out.prompt_token_ids == ids and capsys.readouterr() == ("", "")
    assert out.prompt == llm.tokenizer.apply_chat_template(conversation)
    assert llm.tokenizer.encode(out.prompt, add_special_tokens=False) == ids
    llm.chat([conversation, conversation], greedy(), use_tqdm=True)
    assert "Processed prompts: 100%" in capsys.readouterr().err


def test_cancelling_an_n_request_aborts_every_completion(llm):
    want = llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    doomed = llm.submit(PROMPTS[0], greedy(400, n=3))
    deadline = time.monotonic() + 30
    while llm.engine.stats.num_generated_tokens == 0 or \
            llm.engine.scheduler.num_unfinished < 3:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    others = llm.submit_many([(p, greedy(10)) for p in PROMPTS])
    assert doomed.cancel()
    assert [f.result(timeout=60).token_ids for f in others] == [o.token_ids for o in want]
    assert llm.engine.scheduler.num_unfinished == 0 and doomed.cancelled()


def test_engine_abort_drops_all_n_requests_of_an_output(llama_dir):
    from fusegen.engine.config import EngineConfig
    from fusegen.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.build(str(llama_dir), EngineOptions(dtype="float32")))
    try:
        (single,) = engine.make_request(PROMPTS[0], greedy(20))
        group = engine.make_request(PROMPTS[1], greedy(20, n=3))
        assert [r.index for r in group] == [0, 1, 2]
        assert {r.output_id for r in group} == {group[0].group.request_id}
        for request in (single, *group):
            engine.add(request)
        engine.step()
        dropped = engine.abort({group[0].output_id})
        assert sorted(r.request_id for r in dropped) == sorted(r.request_id for r in group)
        assert {r.finish_reason for r in dropped} == {"abort"}
        assert engine.scheduler.num_unfinished == 1
    finally:
        engine.close()


def test_vllm_engine_options_read_as_fusegen_options(llama_dir, tmp_path):
    options = EngineOptions.from_kwargs(dict(gpu_memory_utilization=0.5, tensor_parallel_size=1,
                                             pipeline_parallel_size=1,
                                             trust_remote_code=False, quantization=None,
                                             enable_lora=False))
    assert options.device_memory == 0.5 and options == EngineOptions(device_memory=0.5)
    with pytest.raises(ModelLoadError, match=r"^revision 'main' was given but .* is a local "
                                             "path, which has no revisions"):
        LLM(str(llama_dir), revision="main")
    # tokenizer: the model folder without its tokenizer loads with another folder's.
    model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
    shutil.copytree(llama_dir, model)
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(model / name, tokenizer / name)
    with pytest.raises(ModelLoadError):
        LLM(str(model), dtype="float32")
    with LLM(str(model), dtype="float32", tokenizer=str(tokenizer)) as llm:
        out = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == Tokenizer.from_dir(llama_dir).encode(PROMPTS[1])
    assert out.token_ids == hf_greedy(llama_dir, out.prompt_token_ids, 8)
    # A tokenizer with ids past the model's embedding is refused before any prompt.
    spec = json.loads((tokenizer / "tokenizer.json").read_text())
    spec["model"]["vocab"]["<x>"] = 5000
    (tokenizer / "tokenizer.json").write_text(json.dumps(spec))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with pytest.raises(ModelLoadError) as info:
        LLM(str(model), dtype="float32", tokenizer=str(tokenizer))
    assert str(info.value) == (f"tokenizer {tokenizer} has ids up to 5000, past the model's "
                               f"vocabulary of {vocab}; pass the tokenizer the model was "
                               "trained with")


REFUSED = [
    (dict(trust_remote_code=True), "trust_remote_code=True: fusegen does not support "
     "trust_remote_code; fusegen runs its own code for each architecture it supports, never "
     "code from a checkpoint; leave it out"),
    (dict(quantization="awq"), "quantization='awq': fusegen does not run that; it runs None "
     "(the checkpoint's own form), 'dequantize' (every weight expanded as it loads), 'gguf' (a "
     "GGUF file's blocks, on CPUs and CUDA GPUs with Triton), 'int8' / 'int4' (fusegen's "
     "group codes: its quantized checkpoints, or a 16-bit one quantized on load) and 'fp8' "
     "(Hugging Face FP8 checkpoints, or a 16-bit one quantized on load; CUDA GPUs of compute "
     "capability 8.9+); a checkpoint in another format converts with `fusegen quantize`"),
    (dict(enable_lora=True), "enable_lora=True: fusegen does not support enable_lora; merge "
     "the adapter into the weights (peft's merge_and_unload) and load the merged checkpoint"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a fraction in (0, 1] "
     "of the free device memory; got 1.5"),
    (dict(gpu_memory_utilization=0.9, device_memory="1GiB"), "gpu_memory_utilization and "
     "device_memory both set the device_memory; pass one"),
    (dict(speculative_config={}), "speculative_config: fusegen does not support this "
     f"engine option; the options are {', '.join(NAMES)} (and vLLM's {', '.join(VLLM_NAMES)})"),
    (dict(tokenizer=""), "tokenizer must be a path or a hub id (org/name); got ''"),
]


@pytest.mark.parametrize("kwargs, message", REFUSED)
def test_options_fusegen_does_not_have_are_refused_by_name(llama_dir, kwargs, message):
    with pytest.raises(EngineConfigError) as info:
        LLM(str(llama_dir), **kwargs)
    assert str(info.value) == message
