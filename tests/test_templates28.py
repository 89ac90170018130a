"""Templates bounded in work as well as in size (issue 28, defect 6). Chat templates (a
checkpoint's, a GGUF file's, one passed in) and prompt templates render in one sandbox
(engine/template_sandbox.py): every loop turn and call takes steps from a budget, a chat
template's text stops at the prompt limit before the tokenizer sees it, a tokenizer panic
is that prompt's error, and the classic sandbox escapes fail with a clear error.

The step budget is cut to `STEPS` here, so nothing waits on a clock."""
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from fusegen.engine import LLM, SamplingParams, template_sandbox
from fusegen.engine.tokenizer import PromptLimit
from fusegen.jobs.cli import main
from fusegen.jobs.engines import close_engines
from fusegen.jobs.errors import JobError
from fusegen.jobs.rows import RowPreparer
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from fusegen.jobs.template import PromptTemplate
from jobs_fixtures import read_output, tiny_model_dir

STEPS = 20_000
CONV = [{"role": "user", "content": "hello"}]
ONE = SamplingParams(max_tokens=1, temperature=0)
LIMIT = PromptLimit(512, 17)  # the tiny model's: 8,704 bytes
PASSED = "the chat_template passed in"
# Loops of 10^10 turns: one whose body calls nothing, one that runs only for a marked row.
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BOOM = ("{% for m in messages %}{% if m['content'] == 'boom' %}" + LOOP + "{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
STEPS_ERROR = ("TemplateTimeError: {origin} took more than 20,000 steps in one render (a loop "
               "turn counts 1, a filter 10 or more, a call 30), the most a template may take: "
               "its loops or recursion never end, or grow too fast with the input")
TOO_LONG = ("prompt_too_long: the conversation as {origin} writes it has {size}; no text over "
            "8,704 bytes fits the context (max_model_len 512 tokens x 17 bytes, the longest "
            "token); shorten it")


@pytest.fixture(autouse=True)
def small_budget(monkeypatch):
    monkeypatch.setattr(template_sandbox, "MAX_STEPS", STEPS)


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_model_dir(), max_num_seqs=4) as llm:
        assert llm.prompt_limit == LIMIT
        yield llm


def _chat_error(llm, source: str) -> str:
    (out,) = llm.chat(CONV, ONE, chat_template=source)
    assert out.finish_reason == "error"
    return out.error


def _prompt_error(source: str) -> str:
    spec = JobSpec(model="/m", input="i", output="o", prompt_template=source)
    (request,) = RowPreparer(spec, prompt_limit=LIMIT).prepare(pa.table({"x": [1]}), 0)
    return request.error


UNSAFE = "SecurityError: access to attribute {!r} of {!r} object is unsafe."
# (template, its error: {kind} "chat" / "prompt", {origin} how errors name the template)
HOSTILE = [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", UNSAFE.format("__class__", "str")),
    ("{{ ''.__class__ }}", UNSAFE.format("__class__", "str")),  # printed: "" before
    ("{{ cycler.__init__.__globals__ }}", UNSAFE.format("__init__", "type")),
    ("{{ joiner().__call__.__globals__ }}", UNSAFE.format("__call__", "Joiner")),
    ("{{ namespace.__init__.__globals__ }}", UNSAFE.format("__init__", "type")),
    ("{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns.__class__ }}",
     UNSAFE.format("__class__", "Namespace")),
    ("{{ self._TemplateReference__context }}",
     UNSAFE.format("_TemplateReference__context", "TemplateReference")),
    ("{{ '{0.__class__}'.format(1) }}", UNSAFE.format("__class__", "int")),
    ("{{ ('{0.__class__}' | attr('format'))(1) }}", UNSAFE.format("__class__", "int")),
    ("{{ 1 | attr('__class__') }}", UNSAFE.format("__class__", "int")),
    ("{{ '%s' | format(''.__class__) }}", UNSAFE.format("__class__", "str")),
    ("{{ '%0*d' | format(10**9, 1) }}", "TemplateSizeError: filter 'format' would build a "
     "value of 1,000,000,014 characters or items; a {kind} template may build at most 8,704"),
    ("{{ range(10**10) }}", "OverflowError: Range too big. The sandbox blocks ranges larger "
     "than MAX_RANGE (100000)."),
    ("{{ 'a' * 10**9 }}", "TemplateSizeError: '*' would build a value of 1,000,000,000 "
     "characters or items; a {kind} template may build at most 8,704"),
    ("{{ [1] * 10**9 }}", "TemplateSizeError: '*' would build a value of 1,000,000,000 "
     "characters or items; a {kind} template may build at most 8,704"),
    ("{{ 7 ** 4000 * 7 ** 4000 }}", "TemplateSizeError: '*' would build a number of 6,738 "
     "digits; a template's numbers may have at most 4,300"),
    ("{{ [1, [2, [3]]] | tojson(indent=10**8) }}", "TemplateSizeError: filter 'tojson' would "
     "build a value of 1,500,000,005 characters or items; a {kind} template may build at "
     "most 8,704"),
    ("{% set ns = namespace(x='ab') %}{% for i in range(100) %}{% set ns.x = ns.x ~ ns.x %}"
     "{% endfor %}", "TemplateSizeError: '~' would build a value of 16,384 characters or "
     "items; a {kind} template may build at most 8,704"),
    # Each value fits, their sum would not: stopped before a thousand are held at once.
    ("{{ range(1000) | map('center', 1000) | list }}", "TemplateSizeError: {origin} built "
     "558,000 characters or items in all in one render; a {kind} template may build at most "
     "557,056 (64 x 8,704)"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "TemplateTimeError: {origin} nested "
     "its macro calls or recursive loops past Python's recursion limit in one render"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
     "{{ f(60) }}", STEPS_ERROR),
    (LOOP, STEPS_ERROR),
    ("{% for i in range(100000) recursive %}{% if loop.depth < 3 %}{{ loop(range(100000)) }}"
     "{% endif %}{% endfor %}", STEPS_ERROR),  # the innermost turns call nothing
]


@pytest.mark.parametrize("source,error", HOSTILE)
def test_a_hostile_chat_template_is_that_conversation_s_error(llm, source, error):
    assert _chat_error(llm, source) == "invalid_prompt: the chat template failed: " + \
        error.format(kind="chat", origin=PASSED)


@pytest.mark.parametrize("source,error", HOSTILE)
def test_a_hostile_prompt_template_is_that_row_s_error(source, error):
    assert _prompt_error(source) == "template_error: row 0: prompt_template: " + \
        error.format(kind="prompt", origin="the prompt template")


def test_chat_templates_have_no_lipsum_and_no_unsafe_helpers(llm):
    assert _chat_error(llm, "{{ lipsum.__globals__ }}") == \
        "invalid_prompt: the chat template failed: UndefinedError: 'lipsum' is undefined"
    for helper in ("raise_exception", "strftime_now"):
        assert _chat_error(llm, f"{{{{ {helper}.__globals__ }}}}") == (
            "invalid_prompt: the chat template failed: " +
            UNSAFE.format("__globals__", "function"))


def test_the_real_step_budget_stops_a_loop_of_ten_billion_turns(llm, monkeypatch):
    monkeypatch.setattr(template_sandbox, "MAX_STEPS", 4_000_000)  # the default
    assert template_sandbox.MAX_STEPS == 4_000_000
    assert _chat_error(llm, LOOP) == "invalid_prompt: the chat template failed: " + \
        STEPS_ERROR.format(origin=PASSED).replace("20,000", "4,000,000")


def test_the_clock_is_a_backstop_naming_the_template(llm, monkeypatch):
    monkeypatch.setattr(template_sandbox, "MAX_STEPS", 4_000_000)
    monkeypatch.setattr(template_sandbox, "TIME_LIMIT", 0.0)  # past at the first step
    assert _chat_error(llm, "{% for m in messages %}{{ m['content'] }}{% endfor %}") == (
        f"invalid_prompt: the chat template failed: TemplateTimeError: {PASSED} ran past 0 s "
        "in one render (1 steps), the longest a template may run: its loops never end, or "
        "grow too fast with the input")
    assert "ran past 0 s" in _prompt_error("{% for i in range(3) %}{{ i }}{% endfor %}")


@pytest.mark.parametrize("source", [
    "{{ ('<a>' * 1000000) | striptags }}",  # markupsafe copies the text once per tag
    "{{ ([[1]] * 1000000) | sum(start=[]) }}",  # each list added copies the sum so far
])
def test_filters_whose_work_outgrows_their_input_take_steps_first(source):
    """Under a large limit (a long context's), one such call would run for hours, with
    no hook inside it where a step or the clock could stop it."""
    with pytest.raises(template_sandbox.TemplateTimeError) as info:
        PromptTemplate(source, max_size=1 << 24).render({})
    assert str(info.value) == STEPS_ERROR.format(origin="the prompt template").split(": ", 1)[1]


def test_templates_longer_than_the_limit_are_refused_before_they_compile(llm):
    source = "{# " + "x" * (1 << 20) + " #}"
    assert _chat_error(llm, source) == (
        "invalid_prompt: the chat template failed: TemplateSizeError: the chat template has "
        "1,048,582 characters; a template may have at most 1,048,576")
    with pytest.raises(JobError, match=r"^prompt_template: the prompt template has 1,048,582 "
                       r"characters; a template may have at most 1,048,576$"):
        PromptTemplate(source)


class _Spy:
    """The tokenizer's backend, recording how much text it was given; `PANIC` in a text
    raises what `tokenizers` raises when it panics (pyo3's PanicException, which is no
    Exception)."""

    def __init__(self, backend):
        self.backend, self.sizes = backend, []

    def encode(self, text, **kw):
        self.sizes.append(len(text))
        if "PANIC" in text:
            raise PanicException("index out of bounds: the len is 3 but the index is 7")
        return self.backend.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.backend, name)


class PanicException(BaseException):
    __module__ = "pyo3_runtime"


def test_chat_text_past_the_prompt_limit_never_reaches_the_tokenizer(llm, monkeypatch):
    spy = _Spy(llm.tokenizer._backend)
    monkeypatch.setattr(llm.tokenizer, "_backend", spy)
    flood = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"  # 100 MB of text
    assert _chat_error(llm, flood) == TOO_LONG.format(origin=PASSED,
                                                      size="more than 8,704 characters")
    # Fewer characters than the limit, more bytes: counted before tokenizing too.
    assert _chat_error(llm, "{{ 'é' * 5000 }}") == TOO_LONG.format(origin=PASSED,
                                                                  size="10,000 bytes")
    assert spy.sizes == []
    (out,) = llm.chat(CONV, ONE, chat_template="{{ 'é' * 200 }}")
    assert out.error is None and spy.sizes == [200]


def test_a_tokenizer_panic_is_that_conversation_s_error(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "_backend", _Spy(llm.tokenizer._backend))
    panic = [{"role": "user", "content": "PANIC"}]
    outs = llm.chat([CONV, panic, CONV], ONE)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error == (
        "invalid_prompt: the tokenizer failed on 61 characters of text (the tokenizers "
        "library panicked: index out of bounds: the len is 3 but the index is 7); shorten or "
        "fix the text")


def test_a_tokenizer_panic_on_a_prompt_or_bad_words_is_that_prompt_s_error(llm, monkeypatch):
    """`generate` too: the panic is one prompt's error output, the others generate."""
    monkeypatch.setattr(llm.tokenizer, "_backend", _Spy(llm.tokenizer._backend))
    outs = llm.generate(["hello", "a PANIC here", "fine"], ONE)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error.startswith("invalid_prompt: the tokenizer failed on 12 characters")
    (out,) = llm.generate(["hello"], SamplingParams(max_tokens=2, bad_words=["PANIC"]))
    assert out.error.startswith("invalid_prompt: bad_words: the tokenizer failed on")


def _checkpoint_with(tmp_path, template: str, form: str):
    """The tiny model with `template` as its own chat template, as a directory or a GGUF
    file; and how errors name where the template came from."""
    if form == "gguf":
        from gguf_checkpoints import write_gguf  # here: it skips without the gguf package

        path = write_gguf(Path(tiny_model_dir()), tmp_path / "model.gguf",
                          extra={"tokenizer.chat_template": template})
        return path, f"the chat template in {path}'s metadata"
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                            "chat_template": template}))
    return path, f"the chat template in {path / 'tokenizer_config.json'}"


@pytest.mark.parametrize("form", ["dir", "gguf"])
def test_a_checkpoint_s_hostile_template_is_named_and_fails_its_job_at_load(form, tmp_path):
    model, origin = _checkpoint_with(tmp_path, LOOP, form)
    with LLM(str(model)) as llm:
        assert _chat_error(llm, None) == "invalid_prompt: the chat template failed: " + \
            STEPS_ERROR.format(origin=origin)
    pq.write_table(pa.table({"conv": [json.dumps(CONV)] * 3}), tmp_path / "in.parquet")
    spec = _spec(tmp_path / "in.parquet", tmp_path / "out", model=str(model))
    message = "the chat template: " + STEPS_ERROR.format(origin=origin)
    with pytest.raises(JobError) as info:
        run_job(spec)
    assert str(info.value).endswith(message) and "\n" not in str(info.value)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["runs"][-1]["error"].endswith(message)


def _spec(inp, out, **kw):
    kw = {"model": tiny_model_dir(), "max_tokens": 2, "temperature": 0, "partition_rows": 4,
          "messages_column": "conv", "progress": "none", **kw}
    return JobSpec(input=str(inp), output=str(out), **kw)


def test_a_chat_template_option_that_hangs_on_one_row_fails_that_row(tmp_path):
    texts = ["hello", "boom", "fine", "x" * 9000]
    pq.write_table(pa.table({"conv": [json.dumps([{"role": "user", "content": t}])
                                      for t in texts]}), tmp_path / "in.parquet")
    result = run_job(_spec(tmp_path / "in.parquet", tmp_path / "out", chat_template=BOOM))
    errors = read_output(tmp_path / "out").column("error").to_pylist()
    assert errors == [
        None,
        "template_error: row 1: chat template: " + STEPS_ERROR.format(origin=PASSED),
        None,
        # The content alone is over the limit: refused before the template renders it.
        "prompt_too_long: row 3: the messages' content has 9,000 bytes; no text over 8,704 "
        "bytes fits the context (max_model_len 512 tokens x 17 bytes, the longest token); "
        "shorten it"]
    assert (result.num_rows, result.num_errors) == (4, 2)
    assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["status"] == \
        "complete"


def test_a_chat_template_that_floods_or_panics_on_one_row_fails_that_row(tmp_path,
                                                                          monkeypatch):
    from fusegen.engine import tokenizer

    backend = tokenizer._Backend  # the job's worker loads its engine with a spying one
    monkeypatch.setattr(tokenizer, "_Backend", type("SpyBackend", (), {
        "from_file": staticmethod(lambda path: _Spy(backend.from_file(path)))}))
    spec = _spec(tmp_path / "in.parquet", tmp_path / "out", max_num_seqs=3, chat_template=(
        "{% for m in messages %}{% if m['content'] == 'flood' %}{% for i in range(100000) %}"
        "{{ 'x' * 1000 }}{% endfor %}{% endif %}{{ m['content'] }}{% endfor %}"))
    texts = ["hello", "flood", "PANIC", "fine"]
    pq.write_table(pa.table({"conv": [json.dumps([{"role": "user", "content": t}])
                                      for t in texts]}), tmp_path / "in.parquet")
    try:
        run_job(spec)
    finally:
        close_engines()  # the next job loads its own
    errors = read_output(tmp_path / "out").column("error").to_pylist()
    assert errors == [
        None,
        "prompt_too_long: row 1: " +
        TOO_LONG.format(origin=PASSED, size="more than 8,704 characters").split(": ", 1)[1],
        "invalid_prompt: row 2: the tokenizer failed on 5 "
        "characters of text (the tokenizers library panicked: index out of bounds: the len "
        "is 3 but the index is 7); shorten or fix the text",
        None]


def test_a_chat_template_option_that_hangs_on_every_row_fails_the_command(tmp_path):
    pq.write_table(pa.table({"conv": [json.dumps(CONV)]}), tmp_path / "in.parquet")
    result = CliRunner().invoke(main, [
        "run", "--model", tiny_model_dir(), "--input", str(tmp_path / "in.parquet"),
        "--output", str(tmp_path / "out"), "--messages-column", "conv",
        "--chat-template", LOOP, "--progress", "none"])
    assert result.exit_code == 1
    (line,) = [x for x in result.output.splitlines() if x.startswith("Error: ")]
    assert line.endswith("the chat template: " + STEPS_ERROR.format(origin=PASSED))


def test_a_prompt_template_that_hangs_on_one_row_fails_that_row(tmp_path):
    pq.write_table(pa.table({"text": ["a", "boom", "b"]}), tmp_path / "in.parquet")
    template = "{% if text == 'boom' %}" + LOOP + "{% endif %}{{ text }}"
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "out", messages_column=None,
                  prompt_template=template))
    assert read_output(tmp_path / "out").column("error").to_pylist() == [
        None, "template_error: row 1: prompt_template: " +
        STEPS_ERROR.format(origin="the prompt template"), None]
