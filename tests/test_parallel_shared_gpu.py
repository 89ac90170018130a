"""Ranks of a device group sharing one GPU ("cuda:0,0,0,0"): each GPU named once per rank
it holds, the group over gloo (NCCL refuses two ranks of a communicator on one GPU),
each sharing rank planning with its share of the GPU's memory. The policy is tested on
CPU; where a GPU is present, the grid's layers ([2, 2, 1], 2d) and the 1-D layers with
overlap (tensor_parallel_size 2, tp_overlap_chunks 2) run on it and must give the
single-process engine's greedy fp32 tokens, as must two pipeline stages on one GPU."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from checkpoints import make_hf_checkpoint
from fusegen import LLM as _LLM
from fusegen import SamplingParams
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory import device as device_module
from fusegen.engine.memory.plan import FreeMemory, ModelShape, plan_engine
from fusegen.engine.options import EngineOptions
from fusegen.engine.parallel.parallel_runner import _with_peers
from fusegen.engine.parallel.plan import (group_backend, rank_devices, rank_infos,
                                          ranks_per_device)

GiB = 2**30
SHAPE = ModelShape(num_layers=8, layer_params=2**20, fixed_params=2**21, kv_width=64,
                   activation_width=1000, vocab_size=1000, max_position_embeddings=256,
                   dtype_bytes=4)


# -- policy (no GPU) ----------------------------------------------------------------------

def test_a_gpu_named_once_per_rank_is_shared_by_those_ranks_over_gloo():
    assert rank_devices("cuda:0,0,0,0", 4, 1) == ["cuda:0"] * 4
    assert rank_devices("cuda:1,0,1", 3, 2) == ["cuda:1", "cuda:0", "cuda:1"]
    assert ranks_per_device(["cuda:1", "cuda:0", "cuda:1"]) == [2, 1, 2]
    assert ranks_per_device(["cpu"] * 4) == [1] * 4  # the machine's memory is divided apart
    assert group_backend(["cuda:0", "cuda:1"]) == "nccl"
    assert group_backend(["cuda:0", "cuda:0"]) == "gloo"
    assert group_backend(["cuda:0", "cuda:1", "cuda:0"]) == "gloo"  # one backend a group
    assert group_backend(["cpu"] * 2) == "gloo"
    infos = rank_infos(2, 2, [range(0, 1), range(1, 2)], ["cuda:0"] * 2 + ["cuda:1"] * 2, 1)
    assert [(i.device, i.backend, i.device_ranks, i.num_threads) for i in infos] == \
        [("cuda:0", "gloo", 2, 1)] * 2 + [("cuda:1", "gloo", 2, 1)] * 2
    own = rank_infos(2, 1, [range(0, 2)], ["cuda:0", "cuda:1"], 1)
    assert [(i.backend, i.device_ranks) for i in own] == [("nccl", 1)] * 2
    for device, world, gpus, message in [
            ("cuda", 4, 1, "a device group of 4 ranks needs 4 GPUs; this machine shows 1: "
                           "lower tensor_parallel_size x pipeline_parallel_size, or name a "
                           "GPU once per rank to share it (\"cuda:0,0,0,0\")"),
            ("cuda:0,0", 4, 1, "device 'cuda:0,0' names 2 GPU(s) for a device group of 4"),
            ("cuda:0,1", 2, 1, "device 'cuda:0,1': the GPUs must be below 1")]:
        with pytest.raises(EngineConfigError) as err:
            rank_devices(device, world, gpus)
        assert str(err.value).startswith(message)


def test_sharing_ranks_each_plan_with_their_share_of_the_gpu(monkeypatch):
    free = {0: 12 * GiB, 1: 5 * GiB}
    monkeypatch.setattr(device_module.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(device_module.torch.cuda, "mem_get_info",
                        lambda d: (free[d.index], 80 * GiB))
    shared = device_module.group_free_memory("cuda:0,0,0,1", 4)
    # GPU 0's 12 GiB over its 3 ranks (4 GiB each) is less than GPU 1's 5 GiB for one
    assert (shared.device, shared.shared_by, shared.on_gpu) == (4 * GiB, 3, True)
    own = device_module.group_free_memory("cuda:0,1", 2)
    assert (own.device, own.shared_by) == (5 * GiB, 1)

    def budget(device_memory, free_memory):
        options = EngineOptions(device_memory=device_memory, host_memory=0)
        return plan_engine(options, SHAPE, free_memory).placement.device_budget

    two = FreeMemory(device=4 * GiB, host=64 * GiB, on_gpu=True, shared_by=2)
    one = FreeMemory(device=8 * GiB, host=64 * GiB, on_gpu=True)
    # device_memory in bytes is the GPU's budget: its two ranks take half each
    assert budget("2GiB", two) == GiB and budget("2GiB", one) == 2 * GiB
    # a fraction is of the GPU's free memory: the same fraction of each rank's share
    assert budget(0.5, two) == 2 * GiB and budget(0.5, one) == 4 * GiB
    # no device_memory: each rank sizes its KV from its share, so the shares fit the GPU
    unset = plan_engine(EngineOptions(host_memory=0), SHAPE, two).placement
    assert unset.device_budget <= 4 * GiB


def test_a_peer_tier_on_a_shared_gpu_is_refused_before_start():
    infos = rank_infos(2, 1, [range(0, 8)], ["cuda:0", "cuda:0"], 1)
    config = SimpleNamespace(device="cuda:0,0",
                             placement=SimpleNamespace(layer_tiers=["device", "peer"]))
    with pytest.raises(EngineConfigError, match=r"^peer_memory: device 'cuda:0,0' puts 2 "
                                                r"ranks on one GPU"):
        _with_peers(infos, config)


# -- on a GPU: tokens --------------------------------------------------------------------

PROMPTS = [list(range(5, 14 + i)) for i in range(0, 40, 5)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# a small KV pool (and so a small pinned swap pool) on every rank: quick to start
LLM = functools.partial(_LLM, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=64)


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


# each a device group on GPU 0 alone
RUNS = {"2d": dict(device="cuda:0,0,0,0", tensor_parallel_size=4, tensor_parallel_mode="2d"),
        "1d-overlap": dict(device="cuda:0,0", tensor_parallel_size=2, tp_overlap_chunks=2),
        # two stages: the activations between them go through the host (gloo)
        "pipeline": dict(device="cuda:0,0", pipeline_parallel_size=2),
        # the grid's sums and gathers started async (CUDA work handles under gloo)
        "2d-overlap": dict(device="cuda:0,0,0,0", tensor_parallel_size=4,
                           tensor_parallel_mode="2d", tp_overlap_chunks=2)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny llama and the single-process engine's tokens on the GPU."""
    path = str(make_hf_checkpoint(tmp_path_factory.mktemp("shared") / "llama", "llama"))
    with LLM(path, device="cuda") as llm:
        return path, _tokens(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(RUNS))
def test_ranks_sharing_one_gpu_give_single_process_tokens(llama, name):
    """Mixed prompt lengths in fused batches, with chunked prefill (16-token steps)."""
    path, reference = llama
    options = RUNS[name]
    ranks = options.get("tensor_parallel_size", 1) * options.get("pipeline_parallel_size", 1)
    with LLM(path, **options) as llm:
        assert _tokens(llm) == reference
        report = llm.engine.memory_report()
        assert report["group"]["devices"] == ["cuda:0"] * ranks
        assert [r["device"]["ranks_on_gpu"] for r in report["ranks"].values()] == \
            [ranks] * ranks
        if options.get("tp_overlap_chunks", 1) > 1:
            overlap = llm.engine.runner.tensor_parallel_overlap()
            assert overlap["layers"]["0.o"]["calls"] > 0
