"""Filters over structured outputs: json(text) with `.field`, `["field"]` and `[index]`.
A row whose text is not JSON, or lacks the field, gives null (dropped by a filter), never
an error; a field no row has is null too, on an empty table (validation) as on data."""
import pyarrow as pa
import pytest

from fusegen.workflows.expr import Expression, ExpressionError
from fusegen.workflows.transform import Transform

ROWS = ['{"label": "pos", "score": 0.9, "tags": ["a", "b"]}',
        '{"label": "neg", "score": 1}',
        'not json {',
        None,
        '{"score": "high"}',  # the minority kind (text among numbers) reads as null
        '[1, 2]',
        '{"label": {"x": 1}, "score": 2}']
TABLE = pa.table({"id": list(range(len(ROWS))), "generated_text": ROWS})


@pytest.mark.parametrize("source, expected", [
    ("json(generated_text).label == 'pos'", [True, False, None, None, None, None, None]),
    ('json(generated_text)["label"] == "neg"', [False, True, None, None, None, None, None]),
    ("json(generated_text).score >= 1", [False, True, None, None, None, None, True]),
    ("json(generated_text).tags[1] == 'b'", [True, None, None, None, None, None, None]),
    ("json(generated_text)[0] + json(generated_text)[-1] == 3",
     [None, None, None, None, None, True, None]),
    ("json(generated_text) is not null", [True, True, False, False, True, True, True]),
    ("json(generated_text).label is null", [False, False, True, True, True, True, True]),
    ("json(generated_text).absent == 'x'", [None] * 7),
    ("lower(json(generated_text).absent) == 'x' or id == 0",
     [True, None, None, None, None, None, None]),
    ("coalesce(json(generated_text).label, 'none') in ['none']",
     [False, False, True, True, True, True, True]),
])
def test_values(source, expected):
    assert Expression(source).mask(TABLE).to_pylist() == expected


def test_a_filter_keeps_the_matching_rows_and_never_fails_on_bad_json():
    t = Transform.from_options({"filter": "json(generated_text).label == 'pos' and "
                                          "json(generated_text).score > 0.5",
                                "select": ["id"]})
    assert t.apply(TABLE).to_pylist() == [{"id": 0}]
    assert Expression("json(generated_text).label == 'pos'").columns == {"generated_text"}
    # validation runs the filter on an empty table: no rows, no field types, no error
    assert t.output_schema(TABLE.schema) == pa.schema([("id", pa.int64())])


def test_each_document_is_parsed_once_per_table(monkeypatch):
    import fusegen.workflows.expr as expr

    calls = []
    real = expr.json.loads
    monkeypatch.setattr(expr.json, "loads", lambda text: calls.append(text) or real(text))
    e = Expression("json(generated_text).label == 'pos' or json(generated_text).score > 1")
    e.mask(TABLE)
    assert len(calls) == 6  # the non-null texts, once each
    e.mask(TABLE)
    assert len(calls) == 12  # a new table (partition) parses again


def test_json_of_a_number_column_is_a_type_error_before_any_row_is_read():
    with pytest.raises(ExpressionError, match="json\\(\\) reads text .* not int64"):
        Expression("json(id).a == 1").mask(TABLE.schema.empty_table())
