"""vLLM's SamplingParams keywords that shape the text: `skip_special_tokens`,
`include_stop_str_in_output` (the stop string, or the stop token's text, kept or left
out, as vLLM's detokenizer does), `spaces_between_special_tokens` (a no-op for fast
tokenizers), and structured output through `guided_decoding=` / `structured_outputs=`."""
import dataclasses

import pytest

from fusegen.engine import LLM, SamplingParams
from fusegen.engine.sampling_params import GuidedDecodingParams, StructuredOutputsParams

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(str(llama_dir), dtype="float32") as engine:
        yield engine


def greedy(max_tokens=8, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def one(llm, params):
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    return out.outputs[0]


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    forced = dict(logit_bias={eos: 100}, ignore_eos=True, max_tokens=3)  # eos x 3, "length"
    kept = one(llm, greedy(skip_special_tokens=False, **forced))
    skipped = one(llm, greedy(**forced))
    assert kept.token_ids == skipped.token_ids == [eos] * 3
    assert (kept.text, skipped.text) == ("<|end_of_text|>" * 3, "")
    # with a stop string the incremental detokenizer keeps them too
    kept = one(llm, greedy(skip_special_tokens=False, stop=["never"], **forced))
    assert kept.text == "<|end_of_text|>" * 3


def test_the_stop_token_that_ended_a_row_is_left_out_of_its_text_unless_asked(llm):
    full = one(llm, greedy(ignore_eos=True))
    stop_id = full.token_ids[3]
    k = full.token_ids.index(stop_id)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    ctx = prompt_ids[-5:]  # the detokenizer's context: decode(prompt + ids) - decode(prompt)

    def text_of(ids):
        return llm.tokenizer.decode(ctx + ids)[len(llm.tokenizer.decode(ctx)):]

    for stop in ([], ["never in the text"]):  # one-shot and incremental detokenizers
        cut = one(llm, greedy(ignore_eos=True, stop_token_ids=[stop_id], stop=stop))
        kept = one(llm, greedy(ignore_eos=True, stop_token_ids=[stop_id], stop=stop,
                               include_stop_str_in_output=True))
        assert cut.token_ids == kept.token_ids == full.token_ids[:k + 1]
        assert (cut.finish_reason, cut.stop_reason) == ("stop", stop_id)
        assert cut.text == text_of(full.token_ids[:k])
        assert kept.text == text_of(full.token_ids[:k + 1]) != cut.text
    # the end-of-sequence token: left out even with special tokens shown
    eos = llm.tokenizer.eos_token_ids[0]
    ended = greedy(logit_bias={eos: 100}, skip_special_tokens=False)
    assert (one(llm, ended).token_ids, one(llm, ended).text) == ([eos], "")
    kept = one(llm, dataclasses.replace(ended, include_stop_str_in_output=True))
    assert (kept.finish_reason, kept.text) == ("stop", "<|end_of_text|>")


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    full = one(llm, greedy(ignore_eos=True))
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    at = full.text.index(stop)
    cut = one(llm, greedy(ignore_eos=True, stop=[stop]))
    kept = one(llm, greedy(ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    assert (cut.text, kept.text) == (full.text[:at], full.text[:at + len(stop)])
    assert kept.stop_reason == cut.stop_reason == stop


def test_spaces_between_special_tokens_is_accepted_and_changes_nothing(llm):
    params = greedy(ignore_eos=True, skip_special_tokens=False)
    same = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                          skip_special_tokens=False, spaces_between_special_tokens=False)
    assert same == params and one(llm, same).text == one(llm, params).text
    with pytest.raises(ValueError, match="^spaces_between_special_tokens must be true or "
                                         "false, got 'no'$"):
        SamplingParams(spaces_between_special_tokens="no")


def test_guided_decoding_objects_constrain_as_fusegens_own_fields(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [(GuidedDecodingParams(choice=["yes", "no"]), dict(choice=["yes", "no"])),
             (StructuredOutputsParams(regex="[a-c]{3}"), dict(regex="[a-c]{3}")),
             (StructuredOutputsParams(json=schema, backend="xgrammar"), dict(json_schema=schema)),
             (GuidedDecodingParams(json_object=True), dict(json_schema={"type": "object"})),
             (GuidedDecodingParams(grammar='start: "x" | "y"'),
              dict(grammar='start: "x" | "y"'))]
    for vllm_object, fields in cases:
        for keyword in ("guided_decoding", "structured_outputs"):
            params = greedy(max_tokens=24, **{keyword: vllm_object})
            assert params == greedy(max_tokens=24, **fields)
        got, want = (one(llm, p) for p in (params, greedy(max_tokens=24, **fields)))
        assert (got.token_ids, got.structured_valid) == (want.token_ids, want.structured_valid)
        assert got.structured_valid is not None  # constrained
    assert one(llm, greedy(guided_decoding=cases[0][0])).text in ("yes", "no")


class _Model:  # a pydantic model class, as vLLM takes for `json`
    @staticmethod
    def model_json_schema():
        return {"type": "object", "properties": {"b": {"type": "string"}}}


GUIDED_REFUSED = [
    (dict(guided_decoding=GuidedDecodingParams()), "guided_decoding must set one of json, "
     "json_object, regex, choice and grammar; got none"),
    (dict(structured_outputs=StructuredOutputsParams(json="{}", regex="a")),
     "structured_outputs must set one of json, json_object, regex, choice and grammar; got "
     "json and regex"),
    (dict(regex="a", guided_decoding=GuidedDecodingParams(choice=["b"])),
     "guided_decoding and regex both set a constraint; pass one"),
    (dict(guided_decoding=GuidedDecodingParams(regex="a"),
          structured_outputs=StructuredOutputsParams(regex="a")),
     "guided_decoding and structured_outputs both set a constraint; pass one"),
    (dict(guided_decoding=GuidedDecodingParams(json={}, whitespace_pattern=r"[ ]?")),
     "guided_decoding.whitespace_pattern: fusegen does not support it; fusegen writes JSON "
     "as json.dumps lays it out; give the schema an \"x-guidance\" whitespace setting "
     "instead"),
    (dict(guided_decoding=GuidedDecodingParams(structural_tag="{}")),
     "guided_decoding.structural_tag: fusegen does not support it; write the tags and their "
     "JSON bodies as a Lark grammar and pass it as grammar"),
    (dict(guided_decoding=GuidedDecodingParams(json={}, disable_additional_properties=True)),
     "guided_decoding.disable_additional_properties: fusegen does not rewrite schemas; add "
     "\"additionalProperties\": false to the schema's objects instead"),
]


@pytest.mark.parametrize("kwargs, message", GUIDED_REFUSED)
def test_guided_decoding_fusegen_cannot_honour_says_what_to_use(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_guided_json_takes_a_pydantic_model_and_no_op_options():
    params = SamplingParams(guided_decoding=GuidedDecodingParams(
        json=_Model, disable_any_whitespace=True, disable_fallback=True, backend="guidance"))
    assert params.json_schema == _Model.model_json_schema()
    import fusegen

    assert fusegen.GuidedDecodingParams is fusegen.StructuredOutputsParams \
        is StructuredOutputsParams


def test_detokenizer_options_are_validated_like_the_others():
    assert SamplingParams(skip_special_tokens=1).validate() == \
        "skip_special_tokens must be true or false, got 1"
    assert SamplingParams(include_stop_str_in_output="yes").validate() == \
        "include_stop_str_in_output must be true or false, got 'yes'"
