"""A job's fingerprint is what lets a rerun resume its output: these are the fingerprints
of known specs, pinned, so that a change to JobSpec, EngineOptions or SamplingParams that
moves any of them (and so would make existing outputs look like another job) fails here."""
import pytest

from fusegen.jobs.identity import JobIdentity
from fusegen.jobs.spec import JobSpec

INPUTS = [{"path": "/data/in.parquet", "num_rows": 10, "size": 1234, "version": "v1"}]
IDENTITY = JobIdentity(dtype="float32", option="auto",
                       model={"files": {"model.safetensors": "abc"}})

# name -> (spec options, its fingerprint)
PINNED = {
    "defaults": ({}, "9623e1a16036b683"),
    "first_fields": (dict(prompt_column="text", id_column="id", chat=True, max_tokens=8,
                          temperature=0.0, top_p=0.5, top_k=4, seed=7, stop=["END", "\n"],
                          output_token_ids=True, block_size=32, max_model_len=512,
                          deterministic=False, partition_rows=100), "dc48e286bf1d783b"),
    "engine_later": (dict(revision="v2", tokenizer="/tok", quantization="int8",
                          tensor_parallel_size=2, dtype="bfloat16"), "23c41a8be800add4"),
    # Options that do not change tokens: the defaults' fingerprint.
    "engine_not_output": (dict(max_num_seqs=4, device="cpu", enforce_eager=True,
                               enable_prefix_caching=False, prefetch_depth=2,
                               pipeline_parallel_size=2, scheduler="tcp://h:1", workers=2,
                               overwrite=True, progress="none", report=True),
                          "9623e1a16036b683"),
    "sampling_later": (dict(min_p=0.1, stop_token_ids=[2, 3], ignore_eos=True, n=2,
                            presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.2, min_tokens=1, logit_bias={"5": -100},
                            bad_words=["foo"], logprobs=2, prompt_logprobs=0),
                       "6d82616a16767e8f"),
    "structured_regex": (dict(regex="[a-z]+", max_tokens=4), "8d70465b55cd9060"),
    "structured_schema": (dict(json_schema='{"type": "object"}'), "b78871653c13bc20"),
    "structured_choice": (dict(choice=["yes", "no"]), "420362c968114110"),
    "structured_grammar": (dict(grammar='root ::= "a"'), "573349bf262dd00e"),
    "response_format": (dict(response_format='{"type": "json_object"}'), "3291b7f5c723bfdb"),
    "chat_later": (dict(messages_column="msgs", chat_template="{{ messages }}",
                        system_prompt="Be brief.", output_format="jsonl"),
                   "4376aa0bc64083fc"),
    "param_columns": (dict(param_columns="temperature,seed"), "0a88c28141826cc0"),
    "prompt_template": (dict(prompt_template="Q: {{ q }}"), "bade9a2aecb7b3f0"),
    "seed_none": (dict(seed=None), "1c9ef6777da2564a"),
    # A GGUF file's unset quantization runs as dequantize, and keeps its fingerprint.
    "gguf_unset": (dict(model="/models/m.gguf"), "83205a7740f44436"),
    "gguf_dequantize": (dict(model="/models/m.gguf", quantization="dequantize"),
                        "731927358181fdd6"),
}


def _spec(**kw):
    return JobSpec(**{"model": "/m", "input": "in.parquet", "output": "out", **kw})


@pytest.mark.parametrize("name", PINNED)
def test_fingerprint_is_pinned(name):
    options, fingerprint = PINNED[name]
    assert _spec(**options).fingerprint(INPUTS, IDENTITY) == fingerprint


def test_default_output_config_is_pinned():
    # The config a manifest records beside the fingerprint: the fields every output has.
    assert _spec().output_config() == {
        "model": "/m", "prompt_column": "prompt", "id_column": None, "prompt_template": None,
        "chat": False, "max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
        "seed": 0, "stop": [], "output_token_ids": False, "dtype": "auto", "block_size": 16,
        "max_model_len": None, "deterministic": True, "partition_rows": 1000}


# A value away from its default for every output field added after fingerprints were.
LATER_VALUES = {
    "messages_column": "msgs", "response_format": {"type": "json_object"},
    "chat_template": "{{ messages }}", "system_prompt": "Be brief.",
    "param_columns": ["seed"], "output_format": "jsonl", "revision": "v2",
    "tokenizer": "/tok", "quantization": "int8", "tensor_parallel_size": 2,
    "tp_overlap_chunks": 2, "tensor_parallel_mode": "2d", "tesseract_depth": 4, "min_p": 0.1,
    "stop_token_ids": [2], "ignore_eos": True, "n": 2, "json_schema": {"type": "object"},
    "regex": "a+", "choice": ["a"], "grammar": 'root ::= "a"', "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.1, "min_tokens": 1,
    "logit_bias": {5: 1.0}, "bad_words": ["foo"], "logprobs": 1, "prompt_logprobs": 1,
    "skip_special_tokens": False, "include_stop_str_in_output": True}
# fields that are only valid beside another's value: compared with that value alone
# (16 ranks: the grid [4, 4, 1] at depth 1, [2, 2, 4] at depth 4)
COMPANIONS = {"tesseract_depth": {"tensor_parallel_mode": "2.5d", "tensor_parallel_size": 16},
              "tp_overlap_chunks": {"tensor_parallel_size": 2}}


def test_fields_after_the_first_enter_the_fingerprint_only_when_set():
    from fusegen.jobs.spec import FIRST_OUTPUT_FIELDS, OUTPUT_FIELDS

    assert FIRST_OUTPUT_FIELDS <= set(OUTPUT_FIELDS)
    assert set(_spec().output_config()) == FIRST_OUTPUT_FIELDS
    assert set(LATER_VALUES) == set(OUTPUT_FIELDS) - FIRST_OUTPUT_FIELDS
    default = _spec().fingerprint(INPUTS, IDENTITY)
    for name, value in LATER_VALUES.items():
        companion = COMPANIONS.get(name, {})
        spec = _spec(**companion, **{name: value})
        assert spec.output_config()[name] == value, name
        base = _spec(**companion).fingerprint(INPUTS, IDENTITY) if companion else default
        assert spec.fingerprint(INPUTS, IDENTITY) != base, name
