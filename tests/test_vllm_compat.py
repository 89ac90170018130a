"""vLLM offline scripts as they are written: the engine keywords they pass (read as
fusegen's, or accepted as no-ops where they ask for what fusegen does anyway, refused
with what to use instead otherwise), `LLM.get_tokenizer()`, prompts from any iterable
(a generator streamed, a bounded number in flight), `fusegen.__version__`, `py.typed`."""
import importlib.metadata
import zipfile

import pytest

from checkpoints import hf_greedy
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.options import EngineOptions

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog.", "One two three",
           "A fourth prompt, a little longer than the others were."]


def greedy(max_tokens=6, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(llama_dir):
    # max_num_seqs=2: generate keeps 4 x 2 prompts in flight at most
    with LLM(str(llama_dir), dtype="float32", max_num_seqs=2) as engine:
        yield engine


def test_vllm_script_keywords_are_read_or_accepted_as_no_ops():
    options = EngineOptions.from_kwargs(dict(
        dtype="half", swap_space=4, disable_log_stats=True, enable_chunked_prefill=True,
        tokenizer_mode="auto", seed=1234, max_model_len=512, enforce_eager=True,
        kv_cache_dtype="auto", load_format="auto", trust_remote_code=False))
    assert options == EngineOptions(dtype="float16", seed=1234, max_model_len=512,
                                    enforce_eager=True)
    assert EngineOptions.from_kwargs(dict(dtype="float")).dtype == "float32"
    assert EngineOptions(dtype="bf16").dtype == "bfloat16"  # the CLI and job files too
    assert EngineOptions.from_kwargs(dict(swap_space=0, disable_log_stats=False,
                                          enable_chunked_prefill=None)) == EngineOptions()


REFUSED = [
    (dict(enable_chunked_prefill=False), "enable_chunked_prefill=False: fusegen accepts "
     "enable_chunked_prefill only as True (or None), a no-op: fusegen always splits a prompt "
     "longer than max_num_batched_tokens into chunks; to run each prompt in one step, set "
     "max_num_batched_tokens to at least the longest prompt's length instead"),
    (dict(tokenizer_mode="mistral"), "tokenizer_mode='mistral': fusegen accepts "
     "tokenizer_mode only as 'auto' (or 'hf'), a no-op: fusegen reads the model's "
     "tokenizer.json with the tokenizers library, as vLLM's auto mode does; it has no slow "
     "or mistral tokenizer mode"),
    (dict(swap_space=-1), "swap_space=-1: fusegen accepts swap_space only as a number of "
     "GiB >= 0, a no-op: vLLM's V1 engine swaps no KV blocks to the CPU either (it "
     "recomputes preempted requests); fusegen's host KV pool is num_host_kv_blocks"),
    (dict(disable_log_stats="yes"), "disable_log_stats='yes': fusegen accepts "
     "disable_log_stats only as true or false, a no-op: fusegen's LLM logs no periodic "
     "engine stats; llm.stats() returns them"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8': fusegen accepts kv_cache_dtype only "
     "as 'auto', a no-op: fusegen keeps KV blocks in the dtype the model runs in"),
    (dict(dtype="fp8"), "dtype must be one of auto, float32, bfloat16, float16; got 'fp8'"),
]


@pytest.mark.parametrize("kwargs, message", REFUSED)
def test_vllm_keywords_fusegen_cannot_honour_say_what_to_use(kwargs, message):
    with pytest.raises(EngineConfigError) as info:
        EngineOptions.from_kwargs(kwargs)
    assert str(info.value) == message


def test_unknown_keyword_lists_fusegens_and_vllms_names():
    with pytest.raises(EngineConfigError) as info:
        EngineOptions.from_kwargs(dict(speculative_config={}))
    assert str(info.value).startswith("speculative_config: fusegen does not support this "
                                      "engine option; the options are dtype, device, ")
    assert str(info.value).endswith(
        "(and vLLM's gpu_memory_utilization, swap_space, disable_log_stats, "
        "enable_chunked_prefill, tokenizer_mode, kv_cache_dtype, load_format, "
        "trust_remote_code, enable_lora)")


def test_llm_takes_a_vllm_scripts_keywords(llama_dir):
    with LLM(str(llama_dir), dtype="float32", swap_space=4, disable_log_stats=True,
             enable_chunked_prefill=True, tokenizer_mode="auto", seed=5, max_model_len=64,
             enforce_eager=True) as llm:
        assert (llm.config.max_model_len, llm.config.options.seed) == (64, 5)
        (out,) = llm.generate(PROMPTS[1], greedy(), use_tqdm=False)
        assert out.token_ids == hf_greedy(llama_dir, out.prompt_token_ids, 6)
    assert "swap_space (only a number of GiB >= 0): no-op" in LLM.__init__.__doc__


def test_get_tokenizer_is_the_one_prompts_are_encoded_with(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    (out,) = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)
    assert tokenizer.encode(PROMPTS[0]) == out.prompt_token_ids
    assert tokenizer.decode(out.token_ids) == out.text
    messages = [{"role": "user", "content": "Hi"}]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=template)
    assert text == "<user>Hi<assistant>"
    assert tokenizer.apply_chat_template(messages, tokenize=True, chat_template=template) \
        == tokenizer.encode(text, add_special_tokens=False)


def test_generate_streams_a_generator_in_input_order(llm, llama_dir):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(30)]
    in_flight = []

    def rows():
        for prompt in prompts:
            in_flight.append(len(llm._futures))  # prompts submitted and not finished
            yield prompt

    outs = llm.generate(rows(), greedy(), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert max(in_flight) <= 8 and len(in_flight) == 30  # 4 x max_num_seqs at most
    want = llm.generate(prompts[:3], greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs[:3]] == [w.token_ids for w in want]
    assert outs[2].token_ids == hf_greedy(llama_dir, outs[2].prompt_token_ids, 6)
    # any iterable: a tuple, a map of dict prompts, one SamplingParams per prompt
    by_tuple = llm.generate(tuple(prompts[:3]), use_tqdm=False,
                            sampling_params=[greedy(), greedy(2), greedy(3)])
    assert [len(o.token_ids) for o in by_tuple] == [6, 2, 3]
    by_map = llm.generate(map(lambda p: {"prompt": p}, prompts[:3]), greedy(),
                          use_tqdm=False)
    assert [o.token_ids for o in by_map] == [w.token_ids for w in want]


def test_a_generators_count_must_match_its_sampling_params(llm):
    with pytest.raises(ValueError, match=r"^2 prompts but 3 SamplingParams; pass one "
                                         "SamplingParams for all, or one per prompt$"):
        llm.generate(iter(PROMPTS[:2]), [greedy()] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^more prompts than the 1 SamplingParams; "):
        llm.generate(iter(PROMPTS[:2]), [greedy()], use_tqdm=False)
    assert llm.generate(iter([]), use_tqdm=False) == []
    assert not llm._futures  # nothing left behind in the engine


def test_progress_bar_counts_a_generators_prompts(llm, capsys):
    llm.generate((p for p in PROMPTS), greedy(), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts: " in err and "4prompt" in err.replace(" ", "")


def test_version_and_typed_marker_in_the_wheel(tmp_path):
    import fusegen
    from test_namespace import _build_wheel

    assert fusegen.__version__ == importlib.metadata.version("fusegen")
    with zipfile.ZipFile(_build_wheel(tmp_path)) as wheel:
        assert wheel.read("fusegen/py.typed") == b""  # PEP 561's marker
        version = wheel.read("fusegen-0.1.0.dist-info/METADATA").decode()
    assert f"\nVersion: {fusegen.__version__}\n" in version
