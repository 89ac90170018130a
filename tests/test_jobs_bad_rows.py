"""One bad row fails alone through the whole job (Dask, the real engine): it becomes its
row's coded error, every other row is generated, the job finishes, and a rerun has
nothing left to do."""
import pyarrow as pa
import pyarrow.parquet as pq

from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import read_output, tiny_model_dir

LIMIT = ("no text over 8,704 bytes fits the context (max_model_len 512 tokens x 17 bytes, "
         "the longest token); shorten it")
PARAMS = "invalid_params: row {0} (id={0}): {1} (per-row column override)"


def _spec(inp, out, **kw):
    kw = {"model": tiny_model_dir(), "max_tokens": 4, "partition_rows": 4, "max_num_seqs": 8,
          "temperature": 1.0, "seed": 3, "progress": "none",
          "max_error_rate": 1.0, **kw}  # rows made to fail: none may stop the job
    return JobSpec(input=str(inp), output=str(out), **kw)


def _utf8(*values) -> pa.Array:
    """A string column of raw bytes, valid UTF-8 or not (as a foreign writer leaves it)."""
    return pa.array(values, pa.binary()).view(pa.string())


def test_bad_cells_and_parameters_fail_their_rows_only(tmp_path):
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({
        "id": list(range(8)),
        "prompt": _utf8(b"good one", b"bad \xff byte", b"x" * 8_000_000, b"good two",
                        b"seed", b"seed", b"stop", b"stop"),
        "seed": [None, None, None, None, 1e20, -1.0, None, None],
        "stop": [None, None, None, None, None, None, 7, 0]}), tmp_path / "in" / "a.parquet")
    pq.write_table(pa.table({"id": [8, 9], "prompt": ["struct stop", "good three"],
                             "stop": [{"END": "x"}, None]}), tmp_path / "in" / "b.parquet")
    spec = _spec(tmp_path / "in", tmp_path / "out", id_column="id")
    res = run_job(spec)
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))  # their `stop` types differ
    out = pa.concat_tables([pq.read_table(p, columns=["id", "prompt", "error",
                                                      "num_generated_tokens"]) for p in parts])
    assert out.column("id").to_pylist() == list(range(10))
    assert out.column("error").to_pylist() == [
        None,
        "invalid_prompt: row 1 (id=1): column 'prompt' is not valid UTF-8 (byte 0xff at "
        "offset 4: invalid start byte); fix or drop this value in the input",
        f"prompt_too_long: row 2 (id=2): the prompt has 8,000,000 bytes; {LIMIT}",
        None,
        PARAMS.format(4, "seed must be an integer in [0, 2**64) or None, got "
                         "100000000000000000000"),
        PARAMS.format(5, "seed must be an integer in [0, 2**64) or None, got -1"),
        PARAMS.format(6, "stop must be a list of non-empty strings, got 7"),
        PARAMS.format(7, "stop must be a list of non-empty strings, got 0"),
        PARAMS.format(8, "stop must be a list of non-empty strings, got {'END': 'x'}"),
        None]
    assert [n > 0 for n in out.column("num_generated_tokens").to_pylist()] == [
        True, False, False, True, False, False, False, False, False, True]
    # Nothing lost: the undecodable input cell is written back byte for byte.
    assert out.column("prompt").cast(pa.binary())[1].as_py() == b"bad \xff byte"
    assert (res.num_rows, res.num_errors) == (10, 7)
    assert res.errors_by_code == {"invalid_prompt": 1, "prompt_too_long": 1,
                                  "invalid_params": 5}
    assert run_job(spec).num_parts_skipped == 3  # a: 2 parts, b: 1; all committed


def test_template_and_chat_rows_fail_alone(tmp_path):
    pq.write_table(pa.table({"text": ["fine", "boom", "sur", "also fine"], "kind": [0, 1, 2, 0]}),
                   tmp_path / "t.parquet")
    template = ('{% if kind == 1 %}{{ text * 100000 }}{% elif kind == 2 %}'
                '{{ text ~ "\\ud800" }}{% else %}{{ text }}{% endif %}')
    run_job(_spec(tmp_path / "t.parquet", tmp_path / "t", prompt_template=template))
    out = read_output(tmp_path / "t")
    assert out.column("error").to_pylist() == [
        None,
        "template_error: row 1: prompt_template: TemplateSizeError: '*' would build a value "
        "of 400,000 characters or items; a prompt template may build at most 8,704",
        "invalid_prompt: row 2: the prompt is not valid Unicode: lone surrogate U+D800 at "
        "character 3; remove it from the text",
        None]
    messages = [[{"role": "user", "content": "y" * 5000}, {"role": "user", "content": "z" * 4000}],
                [{"role": "user", "content": "hello"}]]
    pq.write_table(pa.table({"messages": messages}), tmp_path / "m.parquet")
    run_job(_spec(tmp_path / "m.parquet", tmp_path / "m", chat=True))
    out = read_output(tmp_path / "m")
    assert out.column("error").to_pylist() == [
        f"prompt_too_long: row 0: the messages' content has 9,000 bytes; {LIMIT}", None]
    assert [n > 0 for n in out.column("num_generated_tokens").to_pylist()] == [False, True]
