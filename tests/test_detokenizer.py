"""Incremental detokenization and stop strings on byte-level BPE and SentencePiece byte fallback.

The expected text is what transformers' pipelines return:
decode(prompt + output) minus decode(prompt). Tokenizer.decode equals transformers'
decode (tests/test_tokenizer.py), so it serves as the full-text reference here.
"""
import pytest

from fusegen.engine.detokenizer import IncrementalDetokenizer, detokenize
from fusegen.engine.models.synthetic import build_tokenizer
from fusegen.engine.tokenizer import Tokenizer

KINDS = ["bpe", "sentencepiece"]
PROMPT = "Translate, please:"
CONTINUATION = " Hello world 🎉 and 中文 text, café 😢 fin. The cat sat on the mat."


@pytest.fixture(scope="module", params=KINDS)
def tok(request, tmp_path_factory):
    return Tokenizer.from_dir(build_tokenizer(tmp_path_factory.mktemp(request.param), request.param))


def split(tok, prompt=PROMPT, continuation=CONTINUATION):
    """Token ids of prompt+continuation, split where the prompt's own tokens end."""
    ids = tok.encode(prompt + continuation)
    prompt_ids = tok.encode(prompt)
    assert ids[:len(prompt_ids)] == prompt_ids  # the split falls on a token boundary
    return prompt_ids, ids[len(prompt_ids):]


def expected_text(tok, prompt_ids, output_ids):
    return tok.decode(prompt_ids + output_ids)[len(tok.decode(prompt_ids)):]


def feed(tok, prompt_ids, output_ids, stop=(), chunk=1):
    """Feed ids `chunk` at a time; returns the detokenizer and the index of the token that stopped it."""
    det = IncrementalDetokenizer(tok, prompt_ids, list(stop))
    stopped_at = None
    for i in range(0, len(output_ids), chunk):
        if det.add(output_ids[i:i + chunk]) and stopped_at is None:
            stopped_at = min(i + chunk, len(output_ids)) - 1
    return det, stopped_at


def test_text_splits_characters_across_tokens(tok):
    # Guard: the test text must hold characters split over several tokens, so a naive
    # per-token decode is wrong and the tests below would catch one.
    prompt_ids, output_ids = split(tok)
    pieces = [tok.decode([i]) for i in output_ids]
    assert sum("\ufffd" in p for p in pieces) >= 4
    assert "".join(pieces) != expected_text(tok, prompt_ids, output_ids)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_incremental_equals_full_decode_difference(tok, chunk):
    prompt_ids, output_ids = split(tok)
    expected = expected_text(tok, prompt_ids, output_ids)
    assert expected == CONTINUATION
    det, stopped_at = feed(tok, prompt_ids, output_ids, chunk=chunk)
    assert det.text == expected and not det.stopped and stopped_at is None
    assert detokenize(tok, prompt_ids, output_ids) == det.text


def test_never_commits_garbage_midway(tok):
    # After every token the text is a prefix of the final text, except for a trailing
    # U+FFFD that stands for a character whose remaining bytes have not arrived yet.
    prompt_ids, output_ids = split(tok)
    det = IncrementalDetokenizer(tok, prompt_ids, [])
    num_waits = 0
    for token_id in output_ids:
        det.add([token_id])
        assert CONTINUATION.startswith(det.text.rstrip("\ufffd"))
        num_waits += det.text.endswith("\ufffd")
    assert num_waits >= 2


def test_leading_space_kept_after_prompt(tok):
    prompt_ids, output_ids = split(tok, "Hello", " world and more")
    det, _ = feed(tok, prompt_ids, output_ids)
    assert det.text == " world and more" == detokenize(tok, prompt_ids, output_ids)


def test_output_after_bos_only_prompt(tok):
    # A prompt of only the (skipped) bos token: the first word decodes as at text start.
    prompt_ids, output_ids = [tok.bos_token_id], tok.encode("Hello there", add_special_tokens=False)
    det, _ = feed(tok, prompt_ids, output_ids)
    assert det.text == expected_text(tok, prompt_ids, output_ids) == "Hello there"
    assert detokenize(tok, prompt_ids, output_ids) == det.text


def test_long_prompt_and_special_tokens_skipped(tok):
    prompt_ids, output_ids = split(tok, "A much longer prompt with many words in it, " * 4)
    output_ids = output_ids[:10] + tok.eos_token_ids + output_ids[10:]
    det, _ = feed(tok, prompt_ids, output_ids)
    assert det.text == expected_text(tok, prompt_ids, output_ids)
    assert tok.decode(tok.eos_token_ids, skip_special_tokens=False) not in det.text
    assert detokenize(tok, prompt_ids, output_ids) == det.text


def test_generation_cut_mid_character_reads_like_full_decode(tok):
    # max_tokens may end generation inside a character: the text then ends in U+FFFD,
    # exactly as transformers' decode shows it.
    prompt_ids, output_ids = split(tok)
    cut = next(n for n in range(1, len(output_ids)) if tok.decode(prompt_ids + output_ids[:n]).endswith("\ufffd"))
    det, _ = feed(tok, prompt_ids, output_ids[:cut])
    assert det.text == expected_text(tok, prompt_ids, output_ids[:cut]) and det.text.endswith("\ufffd")
    assert detokenize(tok, prompt_ids, output_ids[:cut]) == det.text


def first_token_containing(tok, prompt_ids, output_ids, needle):
    """Index of the output token after which the full-decode text first contains `needle`."""
    return next(n - 1 for n in range(1, len(output_ids) + 1)
                if needle in expected_text(tok, prompt_ids, output_ids[:n]))


@pytest.mark.parametrize("stop", ["t on th", "🎉 and 中", "é 😢 f"])
@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_across_token_boundaries(tok, stop, chunk):
    prompt_ids, output_ids = split(tok)
    assert not any(stop in tok.decode([i]) for i in output_ids)  # it really spans tokens
    det, stopped_at = feed(tok, prompt_ids, output_ids, [stop], chunk=chunk)
    assert det.stopped and det.text == CONTINUATION[:CONTINUATION.index(stop)]
    if chunk == 1:
        assert stopped_at == first_token_containing(tok, prompt_ids, output_ids, stop)
    text = det.text
    assert det.add(output_ids[:3]) is True and det.text == text  # no-op once stopped


def test_stop_string_at_the_very_start(tok):
    prompt_ids, output_ids = split(tok)
    det, stopped_at = feed(tok, prompt_ids, output_ids, [" Hel"])
    assert det.stopped and det.text == ""
    assert stopped_at == first_token_containing(tok, prompt_ids, output_ids, " Hel")


def test_earliest_stop_string_wins(tok):
    prompt_ids, output_ids = split(tok)
    det, _ = feed(tok, prompt_ids, output_ids, ["mat.", "fin", "café"])
    assert det.text == CONTINUATION[:CONTINUATION.index("café")]
    # Both complete on the same token; the one starting earlier cuts the text.
    assert CONTINUATION.index("on") > CONTINUATION.index("sat on")
    det, _ = feed(tok, prompt_ids, output_ids, ["on", "sat on"])
    assert det.text == CONTINUATION[:CONTINUATION.index("sat on")]


def test_stop_string_never_produced(tok):
    prompt_ids, output_ids = split(tok)
    det, stopped_at = feed(tok, prompt_ids, output_ids, ["not in the text", "🎊"])
    assert not det.stopped and stopped_at is None and det.text == CONTINUATION
