"""The filter language: values with SQL nulls, the functions, and everything it refuses."""
import pyarrow as pa
import pytest

from fusegen.workflows.expr import Expression, ExpressionError
from fusegen.workflows.transform import Transform

TABLE = pa.table({
    "id": [0, 1, 2, 3, None],
    "text": ["Yes", "no", "maybe", None, " x "],
    "ids": [[1], [1, 2], [], None, [3]],
    "error": [None, "null_prompt: row 1", None, None, None],
    "my col": [1.5, 2.5, 3.5, 4.5, 5.5],
})


@pytest.mark.parametrize("source, expected", [
    ("id % 2 == 0", [True, False, True, False, None]),
    ("error is null", [True, False, True, True, True]),
    ("error is not null", [False, True, False, False, False]),
    ("lower(text) in ['yes', 'maybe']", [True, False, True, False, False]),
    ("text not in ['no']", [True, False, True, True, True]),
    ("len(text) > 2 and id < 3", [True, False, True, False, None]),
    ("len(ids) >= 1 or id == 2", [True, True, True, None, True]),
    ("id / 2 > 0.4", [False, True, True, True, None]),
    ("id // 2 == 1", [False, False, True, True, None]),
    ("-id < -1", [False, False, True, True, None]),
    ("text + '!' == 'no!'", [False, True, False, None, False]),
    ("not contains(text, 'y')", [True, True, False, None, True]),  # case-sensitive
    ("startswith(text, 'm') or endswith(text, 's')", [True, False, True, None, False]),
    ("matches(text, '^[A-Z]')", [True, False, False, None, False]),
    ("strip(text) == 'x' and upper(text) == ' X '", [False, False, False, None, True]),
    ("col('my col') > 3", [False, False, True, True, True]),
    ("1 < id <= 3", [False, False, True, True, None]),
    ("coalesce(id, -1) < 0", [False, False, False, False, True]),
    ("round(abs(id - 2) / 3, 1) == 0.3", [False, True, False, True, None]),
    ("true", [True] * 5),
])
def test_values(source, expected):
    assert Expression(source).mask(TABLE).to_pylist() == expected


def test_columns_read():
    assert Expression("error is null and len(text) > col('my col')").columns == \
        {"error", "text", "my col"}


@pytest.mark.parametrize("source, words", [
    ("__import__('os').system('true')", "only these functions"),
    ("__import__('os')", "unknown function __import__()"),
    ("id.__class__ == 1", "attribute access"),
    ("open('/etc/passwd')", "unknown function open()"),
    ("text.lower() == 'x'", "only these functions"),
    ("ids[0] == 1", "indexing"),
    ("(lambda: 1)() == 1", "only these functions"),
    ("[x for x in ids]", "a comprehension"),
    ("id if id else 0", "`a if c else b`"),
    ("f'{id}' == '1'", "an f-string"),
    ("id == null", "write `x is null`"),
    ("id is 3", "`is` only compares with null"),
    ("id in ids", "`in` takes a list of literals"),
    ("len(text, 2) > 1", "len() takes 1 argument"),
    ("contains(text, id)", "second argument must be a quoted string"),
    ("lower(x=text) == 'a'", "positional arguments only"),
    ("id ** 2 > 1", "operator Pow is not allowed"),
    ("id >", "syntax error"),
    ("", "non-empty"),
    # json(): the one place where attribute access and indexing are allowed
    ("id.label == 1", "attribute access (x.y) is only allowed on json(...)"),
    ("generated_text['label'] == 1", "indexing (x[i]) is only allowed on json(...)"),
    ("json(generated_text)[id] == 1", "takes a quoted field name or a literal index"),
    ("json(generated_text, id).a == 1", "json() takes 1 argument(s)"),
])
def test_refused_at_parse_time(source, words):
    with pytest.raises(ExpressionError) as info:
        Expression(source)
    assert words in str(info.value)


@pytest.mark.parametrize("source, words", [
    ("text > 3", "greater cannot take values of types (string, int64)"),
    ("id + 1", "must be true or false"),
    ("lower(id) == 'a'", "utf8_lower cannot take values of types (int64)"),
])
def test_type_errors_on_an_empty_table(source, words):
    with pytest.raises(ExpressionError) as info:
        Expression(source).mask(TABLE.schema.empty_table())
    assert words in str(info.value)


def test_transform_applies_in_order_and_streams_by_table():
    t = Transform.from_options({"drop_errors": True, "filter": "id is not null and id < 3",
                                "select": ["text", "id"], "rename": {"text": "answer"}})
    out = t.apply(TABLE)
    assert out.column_names == ["answer", "id"]
    assert out.to_pylist() == [{"answer": "Yes", "id": 0}, {"answer": "maybe", "id": 2}]
    assert t.output_schema(TABLE.schema) == out.schema


_MODULO_CHECK = """
import pyarrow as pa, pyarrow.compute as pc
if {remove}:
    del pc.modulo  # stands in for a pyarrow release without the function
from fusegen.workflows.expr import Expression
pairs = [(a, b) for a in (-7, -6, -1, 0, 1, 5, 7) for b in (-3, -2, 2, 3)]
table = pa.table({{"a": [a for a, _ in pairs], "b": [b for _, b in pairs],
                  "x": [a + 0.5 for a, _ in pairs]}})
assert Expression("a % b").evaluate(table).to_pylist() == [a % b for a, b in pairs]
assert Expression("x % b").evaluate(table).to_pylist() == [(a + 0.5) % b for a, b in pairs]
"""


@pytest.mark.parametrize("remove", [False, True])
def test_modulo_is_pythons_with_or_without_pyarrows_function(remove):
    """`%` takes the divisor's sign, as in Python, also with a pyarrow that lacks
    `pyarrow.compute.modulo` (older releases): the module imports and computes it. In a
    child process, since the module is imported once per process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _MODULO_CHECK.format(remove=remove)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
