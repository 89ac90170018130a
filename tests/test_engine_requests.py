"""Per-request behaviour through the public API: seeded sampling, stop strings,
bad requests, concurrent producers."""
import math
import signal
import threading

import pytest
import torch

from fusegen.engine import LLM, SamplingParams

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog.",
           "Bonjour, comment allez-vous ?", "1 2 3 4 5 6 7 8 9 10"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=32) as engine:
        yield engine


def greedy(max_tokens=10, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_seeded_sampling_independent_of_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    others = [SamplingParams(max_tokens=m, temperature=0.8, seed=s, ignore_eos=True)
              for m, s in ((5, 1), (30, None), (9, 7))]
    in_batch = llm.generate(PROMPTS[::-1] + [PROMPTS[1]], others[:3] + [greedy()] + [params])
    reordered = llm.generate([PROMPTS[1], PROMPTS[0]], [params, others[1]])
    assert len(alone) == 16
    assert in_batch[-1].token_ids == alone
    assert reordered[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=99,
                                ignore_eos=True)
    assert llm.generate([PROMPTS[1]], other_seed)[0].token_ids != alone


def test_degenerate_sampling_equals_greedy(llm):
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    for params in (dict(temperature=1.0, top_k=1), dict(temperature=0.7, min_p=1.0),
                   dict(temperature=2.0, top_p=1e-6)):
        got = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True, **params))
        assert [o.token_ids for o in got] == want, params


def test_stop_string_cuts_text_across_tokens(llm):
    full = llm.generate([PROMPTS[1]], greedy(max_tokens=24))[0]
    text = full.text
    # A stop string that straddles a token boundary in the middle of the output.
    cut = len(llm.tokenizer.decode(full.token_ids[:8]))
    stop = text[cut - 2:cut + 2]
    assert len(stop) == 4
    out = llm.generate([PROMPTS[1]], greedy(max_tokens=24, stop=[stop, "\x00never"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[:len(out.token_ids)]


def test_stop_token_id_ends_with_stop(llm):
    full = llm.generate([PROMPTS[2]], greedy(max_tokens=12))[0].token_ids
    out = llm.generate([PROMPTS[2]], greedy(max_tokens=12, stop_token_ids=[full[5]]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[:full.index(full[5]) + 1]


BAD = [
    ("", greedy(), "empty_prompt"),
    ([], greedy(), "empty_prompt"),
    ([1, 2, 10_000], greedy(), "token_out_of_vocab: token id 10000 is outside"),
    ([1, -3], greedy(), "token_out_of_vocab: token id -3"),
    (None, greedy(), "invalid_prompt"),
    ("x " * 400, greedy(), "prompt_too_long: the prompt has"),
    ("ok", SamplingParams(temperature=math.nan), "invalid_params: temperature must be"),
    ("ok", SamplingParams(temperature=-0.5), "invalid_params: temperature must be"),
    ("ok", SamplingParams(top_p=0.0), "invalid_params: top_p must be in (0, 1]"),
    ("ok", SamplingParams(top_p=1.5), "invalid_params: top_p must be in (0, 1]"),
    ("ok", SamplingParams(max_tokens=0), "invalid_params: max_tokens must be an integer >= 1"),
    ("ok", SamplingParams(top_k=-2), "invalid_params: top_k"),
    ("ok", SamplingParams(min_p=2.0), "invalid_params: min_p"),
]


def test_bad_requests_fail_alone(llm):
    good = llm.generate(PROMPTS, greedy())
    prompts, params = list(PROMPTS), [greedy()] * len(PROMPTS)
    for prompt, sp, _ in BAD:
        prompts.insert(2, prompt)
        params.insert(2, sp)
    outs = llm.generate(prompts, params)
    bad = outs[2:2 + len(BAD)][::-1]
    for out, (_, _, expected) in zip(bad, BAD):
        assert out.finish_reason == "error" and out.error.startswith(expected.split(":")[0])
        assert expected in out.error, out.error
        assert out.token_ids == [] and out.text == ""
    rest = outs[:2] + outs[2 + len(BAD):]
    assert [o.token_ids for o in rest] == [o.token_ids for o in good]
    assert all(o.finish_reason == "length" and o.error is None for o in rest)
    assert "limit is 256 (max_model_len)" in bad[5].error


def test_submit_from_many_threads(llm):
    want = {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, greedy(8)))}
    results, errors = [], []

    def producer(k):
        try:
            futures = [(p, llm.submit(p, greedy(8))) for p in PROMPTS[k:] + PROMPTS[:k]]
            results.extend((p, f.result(timeout=120)) for p, f in futures)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 16
    assert all(out.token_ids == want[p] for p, out in results)


def test_text_equals_decode_of_tokens(llm):
    outs = llm.generate(PROMPTS, greedy(12))
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        full = llm.tokenizer.decode(ids + out.token_ids)
        assert out.text == full[len(llm.tokenizer.decode(ids)):]


def test_generation_config_eos_list(tmp_path, llama_dir):
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    with LLM(str(model), dtype="float32") as llm:
        free_run = llm.generate([PROMPTS[0]], greedy(12))[0].token_ids
    # Two end-of-sequence ids, the second one produced by the model at step 4.
    (model / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [free_run[0] + 100000, free_run[3]]}))
    with LLM(str(model), dtype="float32") as llm:
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0))[0]
        ignored = llm.generate([PROMPTS[0]], greedy(12))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run[:free_run.index(free_run[3]) + 1]
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"


def test_bad_seed_or_stop_fails_alone_among_requests_in_flight(llm):
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy(12))]
    in_flight = [llm.submit(p, greedy(12)) for p in PROMPTS]
    bad = [llm.submit("ok", SamplingParams(seed=s)) for s in (2**64, -1, 10**20, 1.0)]
    bad += [llm.submit("ok", SamplingParams(stop=s)) for s in (5, {"END": 1}, False)]
    edge = llm.submit("ok", SamplingParams(seed=2**64 - 1, max_tokens=4, ignore_eos=True))
    assert [f.result(timeout=60).token_ids for f in in_flight] == want
    assert [f.result(timeout=60).error for f in bad] == [
        f"invalid_params: seed must be an integer in [0, 2**64) or None, got {s}"
        for s in (2**64, -1, 10**20, 1.0)] + [
        f"invalid_params: stop must be a list of non-empty strings, got {s}"
        for s in (5, {"END": 1}, False)]
    assert edge.result(timeout=60).num_generated_tokens == 4


def test_lone_surrogate_fails_only_its_request(llm):
    want = llm.generate(PROMPTS[:2], greedy())
    outs = llm.generate([PROMPTS[0], "bad \ud800 x", PROMPTS[1]], greedy())
    assert outs[1].error == ("invalid_prompt: the prompt is not valid Unicode: lone "
                             "surrogate U+D800 at character 4; remove it from the text")
    assert [o.token_ids for o in (outs[0], outs[2])] == [o.token_ids for o in want]


def test_huge_prompt_is_refused_before_tokenizing(llm, monkeypatch):
    encoded = []
    encode = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda t, *a: encoded.append(len(t)) or
                        encode(t, *a))
    big = "x " * 500_000
    outs = llm.generate([big, "é" * 2176, PROMPTS[0]], greedy())
    assert outs[0].error == (
        "prompt_too_long: the prompt has 1,000,000 bytes; no text over 4,352 bytes fits the "
        "context (max_model_len 256 tokens x 17 bytes, the longest token); shorten it")
    assert outs[1].error.startswith("prompt_too_long: the prompt has 2177 tokens;")
    assert encoded == [2176, len(PROMPTS[0])] and outs[2].error is None


def _unfinished(llm) -> int:
    return llm.engine.scheduler.num_unfinished


def test_keyboard_interrupt_in_generate_aborts_its_requests(llm, monkeypatch):
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy(40))]
    others = [llm.submit(p, greedy(40)) for p in PROMPTS]  # another caller's requests
    steps = llm.engine.stats.num_steps
    # Ctrl-C from the step thread itself, a few steps into generate's requests: a watcher
    # thread polling for that moment can miss all 200 steps on a busy machine
    step, sent = llm.engine.step, []

    def step_then_interrupt():
        outputs = step()
        if not sent and _unfinished(llm) > len(PROMPTS) and \
                llm.engine.stats.num_steps > steps + 3:
            sent.append(True)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return outputs

    monkeypatch.setattr(llm.engine, "step", step_then_interrupt)
    # Python's own Ctrl-C handler, as in a terminal: a process started in the background
    # by a non-interactive shell inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS * 3, greedy(200))
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    assert _unfinished(llm) <= len(PROMPTS)  # only the other caller's are left
    assert [f.result(timeout=60).token_ids for f in others] == want
    assert _unfinished(llm) == 0
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(40))] == want


def test_cancelled_future_drops_its_request(llm):
    want = [o.token_ids for o in llm.generate(PROMPTS, greedy(20))]
    doomed = llm.submit(PROMPTS[0], greedy(200))
    others = [llm.submit(p, greedy(20)) for p in PROMPTS]
    assert doomed.cancel()
    assert [f.result(timeout=60).token_ids for f in others] == want
    assert _unfinished(llm) == 0 and doomed.cancelled()


def test_the_engine_is_built_on_the_thread_that_steps_it(llama_dir, monkeypatch):
    """Every OpenMP region of an engine on one thread (engine/llm.py): the build (weight
    packing, the dtype probe) happens on the step thread, not the caller's."""
    import fusegen.engine.llm as llm_module

    built_on, stepped_on = [], set()
    real_init, real_step = llm_module.LLMEngine.__init__, llm_module.LLMEngine.step

    def init(self, config):
        built_on.append(threading.current_thread())
        real_init(self, config)

    def step(self):
        stepped_on.add(threading.current_thread())
        return real_step(self)

    monkeypatch.setattr(llm_module.LLMEngine, "__init__", init)
    monkeypatch.setattr(llm_module.LLMEngine, "step", step)
    with LLM(str(llama_dir), dtype="float32") as engine:
        engine.generate(PROMPTS, greedy(4))
    assert len(built_on) == 1 and built_on[0] is not threading.main_thread()
    assert stepped_on == {built_on[0]}


def test_the_engine_thread_takes_the_engines_gpu():
    from fusegen.engine.llm import engine_gpu

    assert engine_gpu("cpu", 3) is None
    assert engine_gpu("cuda", None) == 0  # the caller never touched CUDA
    assert engine_gpu("cuda", 2) == 2  # "cuda": the caller's current GPU
    assert engine_gpu("cuda:1", 2) == 1
    assert engine_gpu("cuda:0,1", 0) is None  # a group's ranks place themselves


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_engine_steps_on_its_gpu(llama_dir, monkeypatch):
    import fusegen.engine.llm as llm_module

    devices = set()
    real_step = llm_module.LLMEngine.step

    def step(self):
        devices.add(torch.cuda.current_device())
        return real_step(self)

    monkeypatch.setattr(llm_module.LLMEngine, "step", step)
    last = torch.cuda.device_count() - 1
    with LLM(str(llama_dir), dtype="float32", device=f"cuda:{last}") as engine:
        engine.generate(PROMPTS, greedy(4))
    assert devices == {last}


def test_a_failed_build_raises_in_the_caller(tmp_path):
    with pytest.raises(Exception) as failed:
        LLM(str(tmp_path / "no-such-model"))
    assert "no-such-model" in str(failed.value)


def test_work_on_a_passing_thread_returns_or_raises_in_the_caller():
    from fusegen.engine.host import on_a_passing_thread

    ran_on = []
    assert on_a_passing_thread(lambda a, b=0: ran_on.append(threading.current_thread())
                               or a + b, 2, b=3) == 5
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()
    with pytest.raises(ZeroDivisionError):
        on_a_passing_thread(lambda: 1 / 0)
