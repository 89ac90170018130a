"""vLLM's sampling options against transformers (fp32, greedy, token-exact): each logits
processor against transformers' own where one exists, presence / frequency penalties
against OpenAI's formula over transformers' logits, logprobs and prompt logprobs against
log_softmax of transformers' logits."""
import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from checkpoints import load_hf
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.logits_processors import LogitsState, bad_words_token_ids
from fusegen.engine.request import Request

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(str(llama_dir), dtype="float32") as llm:
        yield llm


def greedy(**options) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                             **options})


def hf_tokens(path, prompt_ids, processors, eos_token_id=None, max_tokens=MAX_TOKENS):
    """transformers' greedy continuation with `processors`, one prompt, no batching."""
    out = load_hf(path).generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, eos_token_id=eos_token_id,
        logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt_ids):].tolist()


def check_against_hf(llm, llama_dir, params, processors_for, eos_token_id=None):
    """Each prompt's tokens with `params` equal transformers' with the processors, and
    differ from plain greedy on some prompt (the option did something)."""
    outs = llm.generate(PROMPTS, params)
    plain = llm.generate(PROMPTS, greedy())
    changed = False
    for prompt, out, base in zip(PROMPTS, outs, plain):
        ids = llm.tokenizer.encode(prompt)
        assert out.error is None
        assert out.token_ids == hf_tokens(llama_dir, ids, processors_for(ids), eos_token_id), prompt
        changed |= out.token_ids != base.token_ids
    assert changed
    return outs


def test_repetition_penalty_equals_transformers(llm, llama_dir):
    check_against_hf(llm, llama_dir, greedy(repetition_penalty=1.8),
                     lambda ids: [RepetitionPenaltyLogitsProcessor(1.8)])


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's formula over generated tokens, computed directly on transformers' logits."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1])
        return scores - self.frequency * counts.float() - self.presence * (counts > 0).float()


@pytest.mark.parametrize("presence, frequency", [(2.0, 0.0), (0.0, 1.5), (0.7, 0.9), (-1.0, 0.0)])
def test_presence_frequency_penalties_equal_openai_formula(llm, llama_dir, presence, frequency):
    check_against_hf(llm, llama_dir, greedy(presence_penalty=presence, frequency_penalty=frequency),
                     lambda ids: [OpenAIPenalties(len(ids), presence, frequency)])


def test_min_tokens_equals_transformers(llm, llama_dir):
    # The plain greedy output's 3rd token as a stop token: without min_tokens the
    # output ends there; with min_tokens=8 it is masked until 8 tokens were generated.
    ids = llm.tokenizer.encode(PROMPTS[0])
    stop = llm.generate([PROMPTS[0]], greedy())[0].token_ids[2]
    params = greedy(stop_token_ids=[stop], min_tokens=8)
    out = llm.generate([PROMPTS[0]], params)[0]
    assert len(llm.generate([PROMPTS[0]], greedy(stop_token_ids=[stop]))[0].token_ids) == 3
    assert out.token_ids == hf_tokens(llama_dir, ids, [
        MinNewTokensLengthLogitsProcessor(len(ids), 8, [stop])], eos_token_id=[stop])
    assert len(out.token_ids) >= 8 and stop not in out.token_ids[:7]


def test_logit_bias_equals_transformers(llm, llama_dir):
    first = llm.generate([PROMPTS[1]], greedy())[0].token_ids[0]
    bias = {first: -100.0, 77: 6.0, 300: 4.5}
    check_against_hf(llm, llama_dir, greedy(logit_bias=bias), lambda ids: [
        SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])])


def word_at(tok, token_ids, length: int):
    """(j, word): the first word made of `length` output tokens from j that bad_words
    turns back into those tokens (j >= 1 for two tokens: banned after the first)."""
    for j in range(length - 1, len(token_ids) - length + 1):
        word = tok.decode(token_ids[j:j + length])
        if token_ids[j:j + length] in bad_words_token_ids(tok, [word]):
            return j, word
    raise AssertionError(f"no {length}-token word in the output")


@pytest.mark.parametrize("length", [1, 2])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_bad_words_equal_transformers(llm, llama_dir, prompt, length):
    # Banned: a word of the plain output, of one or two tokens. The output is the plain
    # one until the word's last token: banned there (a two-token word's second token is
    # banned only right after its first).
    tok = llm.tokenizer
    ids = tok.encode(prompt)
    plain = llm.generate([prompt], greedy())[0].token_ids
    j, word = word_at(tok, plain, length)
    banned = llm.engine.make_request(prompt, greedy(bad_words=[word]))[0].bad_words_ids
    assert plain[j:j + length] in banned
    # transformers also matches across the prompt: fusegen over generated tokens only
    assert not any(len(s) > 1 and ids[-len(s) + 1:] == s[:-1] for s in banned)
    out = llm.generate([prompt], greedy(bad_words=[word]))[0]
    assert out.token_ids == hf_tokens(llama_dir, ids, [NoBadWordsLogitsProcessor(banned)])
    last = j + length - 1
    assert out.token_ids[:last] == plain[:last] and out.token_ids[last] != plain[last]


def reference_logprobs(llama_dir, token_ids) -> torch.Tensor:
    # [T, V]: log_softmax of transformers' logits at every position of the sequence
    logits = load_hf(llama_dir)(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_position(entry, ref_row: torch.Tensor, token: int, k: int) -> None:
    """One position's dict: the chosen token's logprob and 1-based rank, then the top k."""
    assert entry[token].logprob == pytest.approx(ref_row[token].item(), abs=1e-4)
    assert entry[token].rank == int((ref_row >= ref_row[token]).sum())
    top = ref_row.topk(k) if k else None
    expected_ids = [token] + [t for t in (top.indices.tolist() if k else []) if t != token]
    assert sorted(entry) == sorted(expected_ids)
    for j in range(k):
        t = top.indices[j].item()
        assert entry[t].rank == j + 1
        assert entry[t].logprob == pytest.approx(top.values[j].item(), abs=1e-4)


def check_logprobs(llama_dir, prompt_ids, out, k: int, prompt_k: int | None) -> None:
    completion = out.outputs[0]
    ref = reference_logprobs(llama_dir, prompt_ids + completion.token_ids)
    p = len(prompt_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    for j, (entry, token) in enumerate(zip(completion.logprobs, completion.token_ids)):
        check_position(entry, ref[p - 1 + j], token, k)
    expected = sum(ref[p - 1 + j, t].item() for j, t in enumerate(completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    if prompt_k is None:
        assert out.prompt_logprobs is None
        return
    assert len(out.prompt_logprobs) == p and out.prompt_logprobs[0] is None
    for i in range(1, p):
        check_position(out.prompt_logprobs[i], ref[i - 1], prompt_ids[i], prompt_k)


def test_logprobs_are_of_the_raw_logits(llm, llama_dir):
    # Sampled with a temperature and a penalty: the logprobs are still the model's own.
    params = [greedy(logprobs=5, prompt_logprobs=3),
              SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=0,
                             repetition_penalty=1.5, ignore_eos=True),
              greedy(logprobs=2, logit_bias={5: 50.0})]
    outs = llm.generate(PROMPTS, params)
    for prompt, out, p in zip(PROMPTS, outs, params):
        assert out.error is None
        check_logprobs(llama_dir, llm.tokenizer.encode(prompt), out, p.logprobs,
                       p.prompt_logprobs)
    assert outs[2].token_ids == [5] * MAX_TOKENS  # the bias decided, the logprobs did not move
    assert outs[1].outputs[0].logprobs[0][outs[1].token_ids[0]].decoded_token == \
        llm.tokenizer.decode([outs[1].token_ids[0]], skip_special_tokens=False)


def test_prompt_logprobs_with_chunked_prefill(llama_dir):
    # 8 tokens a step: the long prompt's logprobs arrive over 4 chunks, in order.
    prompt = " ".join(str(i) for i in range(20))
    with LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=8, block_size=4) as llm:
        ids = llm.tokenizer.encode(prompt)
        assert len(ids) > 24
        outs = llm.generate([prompt, PROMPTS[0]], [greedy(max_tokens=4, logprobs=1,
                                                         prompt_logprobs=4), greedy(max_tokens=4)])
        assert llm.stats()["num_steps"] > 4
    check_logprobs(llama_dir, ids, outs[0], 1, 4)
    assert outs[1].prompt_logprobs is None and outs[1].outputs[0].logprobs is None


MIXED = [greedy(), greedy(repetition_penalty=1.8),
         greedy(presence_penalty=1.0, frequency_penalty=1.0),
         greedy(min_tokens=6, stop_token_ids=[46, 413, 8]), greedy(logit_bias={77: 6.0}),
         greedy(bad_words=["mod", "de"]), greedy(logprobs=3, prompt_logprobs=1),
         SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7, ignore_eos=True,
                        frequency_penalty=0.5)]


def test_mixed_batch_rows_get_their_tokens_alone(llm):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(MIXED))]
    together = llm.generate(prompts, MIXED)
    for prompt, params, out in zip(prompts, MIXED, together):
        alone = llm.generate([prompt], params)[0]
        assert out.error is None and out.token_ids == alone.token_ids, params


def test_option_free_batch_builds_nothing_new(llm, monkeypatch):
    from fusegen.engine import model_runner as runner, sampler
    calls = []
    for module, name in ((sampler, "apply_logits_processors"), (sampler, "record_sampled"),
                         (runner, "record_prompt_logprobs")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    llm.generate(PROMPTS, [greedy(), SamplingParams(max_tokens=4, seed=1), greedy(top_k=3)])
    assert calls == []
    llm.generate(PROMPTS[:1], greedy(max_tokens=2, presence_penalty=1.0, logprobs=0,
                                     prompt_logprobs=0))
    assert calls.count("apply_logits_processors") == 2 and calls.count("record_sampled") == 2
    assert calls.count("record_prompt_logprobs") == 1


def test_penalty_counts_are_kept_incrementally():
    request = Request(0, [1, 2, 3], SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2))
    state = LogitsState.make(request, 16, "cpu")
    assert state.seen.nonzero().flatten().tolist() == [1, 2, 3] and state.counts.sum() == 0
    request.token_ids += [5, 5, 7]
    state.catch_up(request)
    request.token_ids.append(5)
    state.catch_up(request)
    state.catch_up(request)  # nothing new: nothing counted twice
    assert state.num_counted == 4
    assert state.counts.tolist() == [0.0] * 5 + [3.0, 0.0, 1.0] + [0.0] * 8
    assert state.seen.nonzero().flatten().tolist() == [1, 2, 3, 5, 7]


@pytest.mark.parametrize("options, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": "1"}, "frequency_penalty must be in [-2, 2], got '1'"),
    ({"repetition_penalty": 0.0},
     "repetition_penalty must be a finite number > 0 (1 disables it), got 0.0"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
    ({"min_tokens": 20, "max_tokens": 16}, "min_tokens must be <= max_tokens (16), got 20"),
    ({"logit_bias": [1, 2]}, "logit_bias must map token ids to numbers, got [1, 2]"),
    ({"logit_bias": {"x": 1.0}},
     "logit_bias keys must be token ids (integers >= 0), got 'x'"),
    ({"logit_bias": {"7": 101}}, "logit_bias values must be in [-100, 100], got 101 for token 7"),
    ({"bad_words": ["ok", " "]}, "bad_words must be a list of non-empty strings, got ['ok', ' ']"),
    ({"logprobs": 21}, "logprobs must be an integer in [0, 20] or None, got 21"),
    ({"prompt_logprobs": True}, "prompt_logprobs must be an integer in [0, 20] or None, got True"),
])
def test_validation_messages(options, message):
    assert SamplingParams(**options).validate() == message


def test_request_errors(llm):
    vocab = llm.engine.vocab_size
    out = llm.generate(["Hello", "Hello"], [greedy(logit_bias={vocab: 1.0, 3: 1.0}),
                                            greedy(max_tokens=2, min_tokens=3)])
    assert out[0].error == (f"invalid_params: logit_bias has token id {vocab} outside the "
                            f"vocabulary [0, {vocab})")
    assert out[1].error == "invalid_params: min_tokens must be <= max_tokens (2), got 3"
    params = SamplingParams(logit_bias={"12": -1.5}, bad_words="spam")
    assert params.logit_bias == {12: -1.5} and params.bad_words == ["spam"]
