"""Prompt templates stay within their size limit: what would build a larger value fails
that render only, before the value is built."""
import tracemalloc

import pytest

from fusegen.jobs.template import PromptTemplate, TemplateSizeError

ROW = {"text": "ab", "lines": "a\nb\nc", "items": ["x", "yy", "zzz"], "n": 3.14159}
LIMIT = "; a prompt template may build at most 1,000"


def _render(source: str, row=ROW, max_size=1000) -> str:
    return PromptTemplate(source, max_size=max_size).render(row)


@pytest.mark.parametrize("source,message", [
    ("{{ text * 100000000 }}", "'*' would build a value of 200,000,000 characters or items"),
    ("{{ items * 10**9 }}", "'*' would build a value of 9,000,000,000 characters or items"),
    ("{{ 10 ** 100000000 }}", "'**' would build a value of 120,000,000 characters or items"),
    ("{% set ns = namespace(s=text) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", "'+' would build a value of 1,024 characters or items"),
    ("{% set ns = namespace(s=text) %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", "'~' would build a value of 1,024 characters or items"),
    ("{% set ns = namespace(s=[text]) %}{% for i in range(20) %}"
     "{% set ns.s = [ns.s, ns.s] %}{% endfor %}{{ ns.s }}",
     "'{{ }}' would write a value of 5,242,878 characters or items"),
    ("{{ text | center(10**9) }}", "filter 'center' would build a value of 1,000,000,000 "
     "characters or items"),
    ("{{ lines | indent(10**6) }}", "filter 'indent' would build a value of 3,000,005 "
     "characters or items"),
    ("{{ text | replace('', text * 400) }}", "filter 'replace' would build a value of "
     "2,402 characters or items"),
    ("{{ items | join(text * 400) }}", "filter 'join' would build a value of 2,406 "
     "characters or items"),
    ("{{ '%1000000000s' | format(text) }}", "filter 'format' would build a value of "
     "1,000,000,014 characters or items"),
    ("{{ [1, 2] | batch(10**9, 0) | list }}", "filter 'batch' would build a value of "
     "1,000,000,002 characters or items"),
    ("{{ text.ljust(10**9) }}", "method 'ljust' would build a value of 1,000,000,000 "
     "characters or items"),
    ("{{ '{:>1000000000}'.format(text) }}", "method 'format' would build a value of "
     "1,000,000,016 characters or items"),
    ("{{ '{:>{}}'.format(text, 10**9) }}", "method 'format' would build a value of "
     "1,000,000,017 characters or items"),
    ("{{ '%*s' % (10**9, text) }}", "'%' would build a value of 1,000,000,014 characters "
     "or items"),
    ("{{ (5).to_bytes(10**9, 'big') }}", "method 'to_bytes' would build a value of "
     "1,000,000,000 characters or items"),
    ("{{ [1, 2] | slice(10**9, 0) | list }}", "filter 'slice' would build a value of "
     "1,000,000,002 characters or items"),
    ("{% macro m() %}{% for i in range(100000) %}{{ text }}{% endfor %}{% endmacro %}{{ m() }}",
     "a macro or block's text would build a value of 1,002 characters or items"),
    ("{% set x %}{% for i in range(100000) %}{{ text }}{% endfor %}{% endset %}",
     "a macro or block's text would build a value of 1,002 characters or items"),
    ("{% for i in range(100000) %}{{ text }}{% endfor %}",
     "the rendered prompt would pass 1,000 characters, the most a prompt template may build"),
])
def test_growing_values_are_refused_before_they_are_built(source, message):
    tracemalloc.start()
    try:
        with pytest.raises(TemplateSizeError) as info:
            _render(source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value) == message + ("" if message.startswith("the rendered") else LIMIT)
    assert peak < 1 << 20, peak  # compiling the template; nothing near the refused size


def test_results_past_the_limit_fail_after_the_call():
    with pytest.raises(TemplateSizeError, match=r"^filter 'tojson' built a value of 1,024 characters"):
        _render("{% set ns = namespace(s=text) %}{% for i in range(20) %}"
                "{% set ns.s = ns.s | tojson %}{% endfor %}")


def test_lipsum_is_not_available():
    assert PromptTemplate("{{ lipsum(10**7) }}").columns == {"lipsum"}


def test_ordinary_templates_render_as_before():
    source = ("{{ text | upper }} {{ '%5.2f' % n }} {{ '{:>6}'.format(text) }} "
              "{{ items | join(', ') }} {{ '-' * 10 }} {{ text ~ '!' }} {{ 2 ** 10 }} "
              "{{ lines | indent(2) }} {{ text | center(6) }} {{ items }}")
    assert _render(source) == ("AB  3.14     ab x, yy, zzz ---------- ab! 1024 a\n  b\n  c"
                               "   ab   ['x', 'yy', 'zzz']")


def test_a_large_input_value_may_be_cut_down():
    big = {"text": "x" * 5000, "items": list(range(5000))}
    assert _render("{{ text | truncate(10) }} {{ items | first }} {{ items | length }}",
                   big) == "x" * 7 + "... 0 5000"
    with pytest.raises(TemplateSizeError, match=r"^'{{ }}' would write a value of 5,000 characters"):
        _render("{{ text }}", big)
