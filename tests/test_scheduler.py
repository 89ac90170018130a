"""Scheduler and block manager policy, on plain integers: no tensors, no model."""
import pytest

from fusegen.engine.block_manager import BlockManager
from fusegen.engine.detokenizer import IncrementalDetokenizer
from fusegen.engine.models.synthetic import build_tokenizer
from fusegen.engine.request import Request, RequestStatus
from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.scheduler import Scheduler
from fusegen.engine.tokenizer import Tokenizer


def make(request_id, prompt_len, max_tokens=8, eos=frozenset()):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(request_id, list(range(1, prompt_len + 1)), params, eos)


def scheduler_with(bm, reqs, max_num_seqs=8, budget=64):
    """A Scheduler over `bm` (max_model_len 64) with `reqs` added in order."""
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      max_model_len=64)
    for r in reqs:
        sched.add(r)
    return sched


def run_step(scheduler, token=7):
    batch = scheduler.schedule()
    sampled = [token if batch.samples(i) else None for i in range(len(batch))]
    return batch, scheduler.update(batch, sampled)


def test_block_manager_exact_ids_and_fifo_free_order():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make(0, 5), make(1, 3)
    bm.allocate(a, 5)  # 5 tokens -> 2 blocks
    bm.allocate(b, 3)
    assert a.block_table == [0, 1] and b.block_table == [2]
    a.num_computed_tokens = 5
    bm.allocate(a, 3)  # 8 tokens still fit 2 blocks
    assert a.block_table == [0, 1]
    bm.allocate(a, 4)  # 9..12 -> a third block
    assert a.block_table == [0, 1, 3] and bm.num_free_blocks == 2
    bm.free(a)
    assert a.block_table == [] and list(bm._free) == [4, 5, 0, 1, 3]
    bm.allocate(b, 9)  # 3 + ... : b has 0 computed, 9 tokens -> 3 blocks: [2] + [4, 5]
    assert b.block_table == [2, 4, 5]
    assert not bm.can_allocate(make(2, 13), 13)  # needs 4, 3 free
    assert bm.can_allocate(make(3, 12), 12)


def test_admission_respects_token_budget_and_max_num_seqs():
    bm = BlockManager(num_blocks=100, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=10, max_model_len=64)
    for i, n in enumerate((6, 6, 3)):
        sched.add(make(i, n))
    batch = sched.schedule()
    # 6 tokens of request 0, then 4 of request 1's 6 (chunked); request 2 waits for a seat.
    assert [r.request_id for r in batch.requests] == [0, 1]
    assert batch.num_scheduled_tokens == [6, 4]
    assert [batch.samples(i) for i in range(2)] == [True, False]
    assert [r.request_id for r in sched.waiting] == [2]
    assert [r.block_table for r in batch.requests] == [[0, 1], [2]]


def test_chunked_prefill_then_decode_counts():
    bm = BlockManager(num_blocks=100, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    req = make(0, 20, max_tokens=3)
    sched.add(req)
    scheduled = []
    while sched.num_unfinished:
        batch, _ = run_step(sched)
        scheduled.append(batch.num_scheduled_tokens[0])
    assert scheduled == [8, 8, 4, 1, 1]  # 20 prompt tokens in chunks, then 2 decodes
    assert req.output_token_ids == [7, 7, 7] and req.finish_reason == "length"
    assert bm.num_free_blocks == 100


def test_finished_request_frees_blocks_at_once_and_admits_waiting():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a, b = make(0, 8, max_tokens=1), make(1, 8, max_tokens=1)
    sched.add(a)
    sched.add(b)
    batch, finished = run_step(sched)
    assert finished == [a, b] and a.finish_reason == "length"
    assert bm.num_free_blocks == 4 and not sched.running
    c = make(2, 16, max_tokens=1)
    sched.add(c)
    batch = sched.schedule()
    assert c.block_table == [0, 1, 2, 3]  # freed ids come back in FIFO order


def test_eos_and_stop_token_ids_finish_with_stop():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a = make(0, 3, eos=frozenset({9}))
    b = Request(1, [1, 2], SamplingParams(max_tokens=8, stop_token_ids=[9]))
    c = Request(2, [1, 2], SamplingParams(max_tokens=8, ignore_eos=True), frozenset({9}))
    for r in (a, b, c):
        sched.add(r)
    _, finished = run_step(sched, token=9)
    assert finished == [a, b]
    assert a.finish_reason == b.finish_reason == "stop" and c.status is RequestStatus.RUNNING


def test_max_model_len_ends_with_length():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=10)
    req = make(0, 8, max_tokens=100)
    sched.add(req)
    while sched.num_unfinished:
        run_step(sched)
    assert req.num_tokens == 10 and req.finish_reason == "length"


def test_preemption_takes_newest_and_recomputes():
    # 5 blocks of 2 tokens. Three requests of 3 prompt tokens take 2 blocks each:
    # only two fit at first.
    bm = BlockManager(num_blocks=5, block_size=2)
    reqs = [make(i, 3, max_tokens=4) for i in range(3)]
    sched = scheduler_with(bm, reqs)
    batch, _ = run_step(sched)
    assert [r.request_id for r in batch.requests] == [0, 1]
    assert [r.block_table for r in reqs[:2]] == [[0, 1], [2, 3]]
    # Step 2: both decode at position 3 (4 tokens fit 2 blocks); no admission of 2
    # (needs 2 blocks, 1 free).
    batch, _ = run_step(sched)
    assert [r.request_id for r in batch.requests] == [0, 1] and bm.num_free_blocks == 1
    # Step 3: position 4 needs a third block each: 0 takes the free one, 1 is preempted.
    batch, _ = run_step(sched)
    assert [r.request_id for r in batch.requests] == [0]
    assert batch.num_preempted == 1 and reqs[0].block_table == [0, 1, 4]
    assert reqs[1].num_computed_tokens == 0 and reqs[1].block_table == []
    assert [r.request_id for r in sched.waiting] == [1, 2]  # preempted goes first
    assert reqs[1].num_preemptions == 1
    # Request 1 comes back and recomputes all 5 of its tokens (prompt + 2 generated).
    while reqs[0].status is not RequestStatus.FINISHED:
        run_step(sched)
    batch = sched.schedule()
    assert batch.requests[0] is reqs[1] and batch.num_scheduled_tokens[0] == 5


def test_progress_under_tiny_block_budget():
    # The pool holds exactly one request at full length: everything still finishes,
    # oldest first, and no request is preempted forever.
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64)
    reqs = [make(i, 4 + i, max_tokens=12 - 2 * i) for i in range(4)]  # 15 KV tokens at most
    for r in reqs:
        assert sched.check_fits(r) is None
        sched.add(r)
    order, steps = [], 0
    while sched.num_unfinished:
        _, finished = run_step(sched)
        order += [r.request_id for r in finished]
        steps += 1
        assert steps < 500, "no progress"
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 0
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert bm.num_free_blocks == 4


def test_request_that_can_never_fit_is_refused_with_the_numbers():
    bm = BlockManager(num_blocks=2, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64)
    message = sched.check_fits(make(0, 6, max_tokens=4))
    assert "10 tokens, which needs 3 KV blocks of 4 tokens" in message
    assert "holds 2 blocks" in message
    assert sched.check_fits(make(1, 6, max_tokens=3)) is None  # 8 KV tokens fit 2 blocks


def test_external_finish_removes_from_queues():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    a, b = make(0, 4), make(1, 4)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish([a, b], "stop")
    assert sched.num_unfinished == 0 and bm.num_free_blocks == 16
    assert a.finish_reason == b.finish_reason == "stop"


@pytest.mark.parametrize("budget", [1, 3, 64])
def test_every_token_computed_exactly_once_per_admission(budget):
    bm = BlockManager(num_blocks=64, block_size=4)
    reqs = [make(i, 5 + 3 * i, max_tokens=3) for i in range(5)]
    sched = scheduler_with(bm, reqs, max_num_seqs=3, budget=budget)
    computed = {r.request_id: 0 for r in reqs}
    while sched.num_unfinished:
        batch, _ = run_step(sched)
        assert batch.num_tokens <= budget and len(batch) <= 3
        for r, n in zip(batch.requests, batch.num_scheduled_tokens):
            computed[r.request_id] += n
    # prompt + generated tokens minus the last sampled one (never fed back)
    assert computed == {r.request_id: r.num_tokens - 1 for r in reqs}


def test_swap_out_and_in_exact_blocks():
    # 5 device blocks of 2 tokens, 4 host blocks. As in the recompute test, request 1
    # must give way at step 3, but now its blocks go to the host pool and come back.
    bm = BlockManager(num_blocks=5, block_size=2, num_host_blocks=4)
    reqs = [make(i, 3, max_tokens=4) for i in range(3)]
    sched = scheduler_with(bm, reqs)
    run_step(sched)
    run_step(sched)
    batch, _ = run_step(sched)
    assert batch.swap_out == [(2, 0), (3, 1)]  # request 1's device blocks -> host 0, 1
    assert reqs[1].status is RequestStatus.SWAPPED and reqs[1].host_block_table == [0, 1]
    assert reqs[1].num_computed_tokens == 4  # kept: no recompute
    assert bm.num_free_host_blocks == 2 and [r.request_id for r in sched.swapped] == [1]
    # Request 2 (never run) must not overtake the swapped request 1.
    while reqs[0].status is not RequestStatus.FINISHED:
        batch, _ = run_step(sched)
        assert reqs[2] not in batch.requests
    batch = sched.schedule()
    # Request 0 freed [0, 1, 4] -> free list is [2, 3, 0, 1, 4]; 1 comes back into
    # blocks 2, 3 and gets one more (0) for its 5th token.
    assert batch.requests[0] is reqs[1] and batch.num_scheduled_tokens[0] == 1
    assert batch.swap_in == [(0, 2), (1, 3)]
    assert reqs[1].block_table == [2, 3, 0] and bm.num_free_host_blocks == 4


def test_swap_falls_back_to_recompute_when_host_is_full():
    bm = BlockManager(num_blocks=5, block_size=2, num_host_blocks=1)
    reqs = [make(i, 3, max_tokens=4) for i in range(2)]
    sched = scheduler_with(bm, reqs)
    for _ in range(3):
        batch, _ = run_step(sched)
    assert batch.swap_out == [] and batch.num_preempted == 1
    assert reqs[1].status is RequestStatus.WAITING and reqs[1].num_computed_tokens == 0


def test_swapping_progress_and_exact_counts():
    bm = BlockManager(num_blocks=6, block_size=2, num_host_blocks=6)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64)
    reqs = [make(i, 2 + i % 3, max_tokens=6 + i // 2) for i in range(6)]
    for r in reqs:
        assert sched.check_fits(r) is None
        sched.add(r)
    swaps = steps = 0
    while sched.num_unfinished:
        batch, _ = run_step(sched)
        swaps += len(batch.swap_out)
        steps += 1
        assert steps < 500
        assert bm.num_used_blocks == sum(len(r.block_table) for r in sched.running)
    assert swaps > 0
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert bm.num_free_blocks == 6 and bm.num_free_host_blocks == 6


@pytest.mark.parametrize("max_tokens", [32, 7])
def test_stop_string_finishes_in_update_once_and_frees_blocks_once(tmp_path, max_tokens):
    # "Say:" + " one two three four" in the synthetic BPE vocabulary; the stop string
    # " thr" straddles " th" + "ree", the 7th output token. With max_tokens=7 that token
    # also reaches the length limit: the stop string still decides the reason.
    tok = Tokenizer.from_dir(build_tokenizer(tmp_path, "bpe"))
    prompt, output = [510, 50, 311, 25], [323, 68, 256, 86, 78, 322, 383, 272, 337]
    assert tok.encode("Say: one two three four") == prompt + output
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[" thr"])
    a = Request(0, prompt, params, detokenizer=IncrementalDetokenizer(tok, prompt, [" thr"]))
    b = make(1, 4, max_tokens=32)
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    sched.add(a)
    sched.add(b)
    finished_per_step = []
    for step in range(len(output)):
        batch = sched.schedule()
        sampled = [output[step] if r is a else 7 for r in batch.requests]
        finished_per_step.append(sched.update(batch, sampled))
    assert finished_per_step == [[]] * 6 + [[a], [], []]
    assert a.finish_reason == "stop" and a.output_token_ids == output[:7]
    assert a.detokenizer.text == " one two"
    assert sched.running == [b] and a.block_table == []
    # a's blocks went back once: the free list and b's table hold each id exactly once.
    assert sorted(list(bm._free) + b.block_table) == list(range(16))


def cached_manager(num_blocks, block_size=4, num_host_blocks=0):
    return BlockManager(num_blocks, block_size, num_host_blocks, enable_caching=True,
                        cache_salt="test")


def prompt_request(request_id, prompt, max_tokens=8):
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def cached_scheduler(prompts, max_num_seqs=8, budget=64):
    """16 blocks of 4 tokens with prefix caching; a waiting request per prompt."""
    bm = cached_manager(16)
    reqs = [prompt_request(i, p) for i, p in enumerate(prompts)]
    return bm, scheduler_with(bm, reqs, max_num_seqs, budget), reqs


def test_prefix_cached_admission_schedules_only_the_rest():
    shared = list(range(1, 13))  # three full blocks of 4
    bm, sched, (a,) = cached_scheduler([shared + [50]])
    run_step(sched)
    b = prompt_request(1, shared + [60, 61])
    sched.add(b)
    batch, _ = run_step(sched)
    # a decodes one token; b takes blocks 0, 1, 2 and computes its last two tokens
    assert batch.requests == [a, b] and batch.num_scheduled_tokens == [1, 2]
    assert b.block_table == [0, 1, 2, 4] and b.num_cached_tokens == 12
    assert batch.num_cached_tokens == 12 and batch.num_prompt_tokens == 2
    assert [bm.ref_count(i) for i in range(5)] == [2, 2, 2, 1, 1]


def test_requests_admitted_in_one_step_share_the_blocks_scheduled_before_them():
    # The blocks a's prefill fills are recorded when allocated: b, admitted right after
    # in the same step, reads them in the same forward pass (each layer writes every
    # token's keys before any attention reads them).
    bm, sched, (a, b) = cached_scheduler([list(range(1, 14))] * 2)
    batch = sched.schedule()
    assert batch.num_scheduled_tokens == [13, 1]
    assert a.block_table == [0, 1, 2, 3] and b.block_table == [0, 1, 2, 4]
    assert batch.num_cached_tokens == 12 and batch.num_prompt_tokens == 14


def test_chunked_prefill_caches_a_block_once_its_chunk_fills_it():
    bm, sched, (a, b) = cached_scheduler([list(range(1, 14)), list(range(1, 11))],
                                         max_num_seqs=1, budget=6)
    run_step(sched)  # a: tokens 0..5, block 0 full, block 1 half
    assert bm.computed_blocks(b) == [0]
    run_step(sched)  # a: tokens 6..11, blocks 1 and 2 full
    assert bm.computed_blocks(b) == [0, 1]  # b's 10 tokens: at most 2 blocks, last runs


@pytest.mark.parametrize("num_host_blocks", [0, 8])
def test_shared_prefix_progress_under_preemption_with_exact_reference_counts(num_host_blocks):
    # 10 blocks of 2 tokens for 6 requests sharing a 5-token prefix, each growing to
    # 11 tokens: preempted again and again (recompute, or swap with a host pool).
    bm = cached_manager(10, block_size=2, num_host_blocks=num_host_blocks)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64)
    reqs = [prompt_request(i, [9, 8, 7, 6, 5, i], max_tokens=5) for i in range(6)]
    for r in reqs:
        assert sched.check_fits(r) is None
        sched.add(r)
    preempted = cached = swapped = steps = 0
    while sched.num_unfinished:
        batch, _ = run_step(sched)
        preempted += batch.num_preempted
        cached += batch.num_cached_tokens
        swapped += len(batch.swap_out)
        steps += 1
        assert steps < 500
        held = [b for r in sched.running for b in r.block_table]
        assert bm.num_used_blocks == len(set(held))
        assert all(bm.ref_count(b) == held.count(b) for b in set(held))
    assert preempted > 0 and cached > 0 and (swapped > 0) == (num_host_blocks > 0)
    assert all(r.num_output_tokens == 5 for r in reqs)
    assert bm.num_free_blocks == 10 and bm.num_free_host_blocks == num_host_blocks
    # every request after the first found the prefix's two full blocks when first admitted
    assert [r.num_cached_tokens for r in reqs] == [0, 4, 4, 4, 4, 4]


def _submit(batch):
    for req in batch.requests:
        req.num_in_flight += 1
    return batch


def _collect(scheduler, batch, token=7):
    sampled = [token if batch.samples(i) else None for i in range(len(batch))]
    return scheduler.update(batch, sampled)


def test_requests_in_flight_are_neither_rescheduled_nor_preempted():
    """A pipeline keeps two batches in flight: the second never holds a request of the
    first, and making room never takes a request whose batch is out."""
    bm = BlockManager(num_blocks=5, block_size=2)
    reqs = [make(i, 3, max_tokens=4) for i in range(3)]
    sched = scheduler_with(bm, reqs)
    first = _submit(sched.schedule(max_batch_seqs=1))
    second = _submit(sched.schedule(max_batch_seqs=1))
    assert [r.request_id for r in first.requests] == [0]
    assert [r.request_id for r in second.requests] == [1]
    assert [r.block_table for r in reqs] == [[0, 1], [2, 3], []]
    assert not sched.schedule(max_batch_seqs=1)  # 0 and 1 out; 2 needs 2 blocks, 1 free
    _collect(sched, first)
    # 0 decodes at position 3 (no new block); 1 is still out, so it cannot be a victim.
    third = _submit(sched.schedule(max_batch_seqs=1))
    assert third.requests == [reqs[0]] and third.num_preempted == 0
    _collect(sched, second)
    _collect(sched, third)
    # Position 4: 0 needs a third block and takes the free one; 1 decodes at position 3.
    fourth = _submit(sched.schedule(max_batch_seqs=1))
    assert fourth.requests == [reqs[0]] and reqs[0].block_table == [0, 1, 4]
    fifth = _submit(sched.schedule(max_batch_seqs=1))
    assert fifth.requests == [reqs[1]] and bm.num_free_blocks == 0
    _collect(sched, fourth)
    _collect(sched, fifth)
    sixth = _submit(sched.schedule(max_batch_seqs=1))  # 0 at position 5, in its blocks
    assert sixth.requests == [reqs[0]]
    # 1 needs a block at position 4 and none is free: the newest request not in flight
    # is 1 itself (0, older, is out), so 1 is preempted and 0 keeps its blocks.
    seventh = sched.schedule(max_batch_seqs=1)
    assert seventh.requests == [] and seventh.num_preempted == 1
    assert reqs[0].block_table == [0, 1, 4] and reqs[1].block_table == []
    assert [r.request_id for r in sched.waiting] == [1, 2]
    _collect(sched, sixth)
    assert reqs[0].num_computed_tokens == 6 and not reqs[0].in_flight


def test_request_aborted_in_flight_is_dropped_when_its_batch_returns():
    bm = BlockManager(num_blocks=8, block_size=2)
    reqs = [make(i, 3) for i in range(2)]
    sched = scheduler_with(bm, reqs)
    batch = _submit(sched.schedule())
    sched.finish([reqs[1]], "abort")
    assert bm.num_free_blocks == 6 and reqs[1].finish_reason == "abort"
    assert _collect(sched, batch) == []  # its token discarded, its blocks freed once
    assert reqs[1].num_computed_tokens == 0 and reqs[1].output_token_ids == []
    assert reqs[0].num_computed_tokens == 3 and bm.num_free_blocks == 6
