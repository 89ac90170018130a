"""Cooperative KV placement's block policy (engine/split_blocks.py), on plain integers:
a request's first `device_quota` blocks on the device, the rest in the host pool (ids
from num_blocks on); exact ids, counts and eviction order."""
import pytest

from fusegen.engine.request import Request
from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.scheduler import Scheduler
from fusegen.engine.split_blocks import SplitBlockManager


def make(request_id, prompt_len, max_tokens=8, first=1):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(request_id, list(range(first, first + prompt_len)), params, frozenset())


def test_device_blocks_then_host_blocks_exact_ids():
    bm = SplitBlockManager(num_blocks=6, block_size=4, num_host_blocks=5, device_quota=2)
    a, b = make(0, 13), make(1, 5)
    bm.allocate(a, 13)  # 4 blocks: 2 on the device, 2 in the host pool (ids 6..)
    bm.allocate(b, 5)
    assert a.block_table == [0, 1, 6, 7] and b.block_table == [2, 3]
    assert bm.split(a.block_table) == ([0, 1], [0, 1])
    assert (bm.num_free_blocks, bm.num_free_host_blocks) == (2, 3)
    b.num_computed_tokens = 5
    bm.allocate(b, 4)  # 9 tokens: its third block goes to the host pool
    assert b.block_table == [2, 3, 8]
    bm.free(a)
    assert list(bm._free) == [4, 5, 0, 1] and list(bm._host_free) == [9, 10, 6, 7]
    assert bm.max_request_blocks == 7


def test_admission_counts_each_pool():
    bm = SplitBlockManager(num_blocks=4, block_size=4, num_host_blocks=2, device_quota=2)
    assert bm.can_allocate(make(0, 16), 16)  # 2 + 2
    assert not bm.can_allocate(make(1, 17), 17)  # 2 + 3: the host pool has 2
    bm.allocate(make(2, 8), 8)
    bm.allocate(make(3, 4), 4)  # 3 device blocks taken
    assert not bm.can_allocate(make(4, 8), 8)  # 2 device blocks wanted, 1 free
    assert bm.can_allocate(make(5, 4), 4)


def test_prefix_hits_in_both_pools_and_eviction_order():
    bm = SplitBlockManager(num_blocks=4, block_size=4, num_host_blocks=4, device_quota=2,
                           enable_caching=True)
    a = make(0, 17)
    bm.allocate(a, 17)  # 5 blocks: [0, 1] + host [4, 5, 6]; 4 full ones registered
    assert a.block_table == [0, 1, 4, 5, 6]
    b = make(1, 17)
    hits = bm.computed_blocks(b)
    assert hits == [0, 1, 4, 5]  # device and host blocks alike
    assert bm.can_allocate(b, 1, hits)
    bm.allocate(b, 1, hits)
    assert b.block_table == [0, 1, 4, 5, 7] and b.num_computed_tokens == 16
    assert [bm.ref_count(x) for x in (0, 1, 4, 5, 6, 7)] == [2, 2, 2, 2, 1, 1]
    bm.free(a)
    bm.free(b)
    # cached blocks stay evictable in their pool, a request's last block first
    assert list(bm._evictable) == [1, 0] and list(bm._host_evictable) == [5, 4]
    assert list(bm._free) == [2, 3] and list(bm._host_free) == [6, 7]
    c = make(2, 33, first=100)  # other tokens: no hits; 9 blocks wanted, too many
    assert not bm.can_allocate(c, 33)
    bm.allocate(c, 24)  # 6 blocks: device 2, 3 then host 6, 7, and evicts 5
    assert c.block_table == [2, 3, 6, 7, 5] + [4] and bm.num_free_host_blocks == 0
    assert bm.computed_blocks(make(3, 17)) == [0, 1]  # the evicted host blocks no longer hit


def test_never_swaps_and_preempts_by_recompute():
    bm = SplitBlockManager(num_blocks=4, block_size=4, num_host_blocks=3, device_quota=2)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    a, b = make(0, 12, max_tokens=10), make(1, 12, max_tokens=10)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # a: 3 blocks (2 + 1 host), b: 3 (2 + 1 host)
    assert [r.block_table for r in batch.requests] == [[0, 1, 4], [2, 3, 5]]
    sched.update(batch, [7, 7])
    batch = sched.schedule()  # each decode needs a 4th block: one host block left
    assert batch.requests == [a] and batch.num_preempted == 1 and not batch.swap_out
    assert a.block_table == [0, 1, 4, 6] and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.waiting[0] is b


def test_check_fits_counts_the_quota_and_the_host_pool():
    bm = SplitBlockManager(num_blocks=8, block_size=4, num_host_blocks=3, device_quota=2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    assert sched.check_fits(make(0, 12, max_tokens=9)) is None  # 20 tokens: 5 blocks
    refusal = sched.check_fits(make(1, 12, max_tokens=10))
    assert "the KV cache holds 5 blocks a request can use" in refusal


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_host_blocks=0, device_quota=1), "needs host KV blocks; got 0"),
    (dict(num_host_blocks=2, device_quota=5), r"device_quota 5 must be 1..4"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SplitBlockManager(num_blocks=4, block_size=4, **kwargs)
