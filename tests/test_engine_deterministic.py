"""Deterministic (batch-invariant) mode: a request's logits and tokens are bit-identical
alone, in batches of any size and order, under any prefill chunking and preemption."""
import random

import pytest
import torch

from checkpoints import make_hf_checkpoint
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.models.decoder import CausalLM
from fusegen.engine.sampler import Sampler

NUM_REQUESTS = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("det"), "llama", "bpe",
                              hidden_size=128, intermediate_size=256, num_hidden_layers=3)


def _requests():
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 60))]
               for _ in range(NUM_REQUESTS)]
    # Every request has its own seed: it names the request's logits below. Half sample.
    params = [SamplingParams(max_tokens=6, temperature=0.8 if i % 2 else 0.0, seed=1000 + i,
                             ignore_eos=True) for i in range(NUM_REQUESTS)]
    return prompts, params


@pytest.fixture
def recorded(monkeypatch):
    """seed -> the logits rows its request sampled from, in order."""
    logits_by_seed: dict[int, list[torch.Tensor]] = {}
    real = Sampler.__call__

    def recording(self, logits, batch):
        for row, p in zip(logits, batch.params):
            logits_by_seed.setdefault(p.seed, []).append(row.clone())
        return real(self, logits, batch)

    monkeypatch.setattr(Sampler, "__call__", recording)
    # every row's logits through the sampler, greedy ones too (not the argmax head, nor
    # a recorded decode step's head: engine/graphs.py)
    monkeypatch.setattr(CausalLM, "greedy_tokens", lambda *args: None)
    monkeypatch.setattr(Sampler, "plain_greedy", staticmethod(lambda requests: False))
    return logits_by_seed


def _run(model_dir, recorded, order, batches, dtype="float32", **options):
    prompts, params = _requests()
    recorded.clear()
    tokens = {}
    with LLM(str(model_dir), dtype=dtype, deterministic=True, **options) as llm:
        for start in range(0, len(order), batches):
            chunk = order[start:start + batches]
            outs = llm.generate([prompts[i] for i in chunk], [params[i] for i in chunk])
            tokens.update({i: o.token_ids for i, o in zip(chunk, outs)})
        stats = llm.stats()
    logits = {seed: torch.stack(rows) for seed, rows in recorded.items()}
    return tokens, logits, stats


def _assert_same(a, b):
    assert a[0] == b[0]  # token ids of every request
    assert a[1].keys() == b[1].keys()
    for seed in a[1]:
        assert torch.equal(a[1][seed], b[1][seed]), f"request seed {seed}: logits differ"


def test_bit_identical_alone_batched_chunked_and_preempted(model_dir, recorded):
    order = list(range(NUM_REQUESTS))
    alone = _run(model_dir, recorded, order, batches=1, max_num_seqs=8)
    together = _run(model_dir, recorded, order, batches=NUM_REQUESTS, max_num_seqs=64)
    _assert_same(alone, together)
    shuffled = order[:]
    random.Random(3).shuffle(shuffled)
    # Batches of 37 in another order, prompts split into chunks of at most 16 tokens.
    chunked = _run(model_dir, recorded, shuffled, batches=37, max_num_seqs=23,
                   max_num_batched_tokens=16)
    _assert_same(alone, chunked)
    # A pool too small for the running batch: requests are preempted and recomputed.
    # (Same block size: attention sums a row's keys block by block.)
    preempted = _run(model_dir, recorded, shuffled, batches=NUM_REQUESTS, max_num_seqs=32,
                     num_kv_blocks=40, num_host_kv_blocks=0)
    assert preempted[2]["num_preemptions"] > 0
    _assert_same(alone, preempted)
    swapped = _run(model_dir, recorded, shuffled, batches=NUM_REQUESTS, max_num_seqs=32,
                   num_kv_blocks=40, num_host_kv_blocks=200, host_memory="256MiB")
    assert swapped[2]["num_swapped_blocks"] > 0
    _assert_same(alone, swapped)


def test_bf16_batched_equals_alone(model_dir, recorded):
    order = list(range(0, NUM_REQUESTS, 5))
    alone = _run(model_dir, recorded, order, batches=1, dtype="bfloat16")
    chunked = _run(model_dir, recorded, order[::-1], batches=len(order), dtype="bfloat16",
                   max_num_batched_tokens=24)
    _assert_same(alone, chunked)
