"""The peer tier's channel (engine/parallel/peer.py) between CPU ranks over gloo, with and
without per-pair payload communicators (the NCCL path's logic: requests over the shared
gloo group, payloads over a communicator per (holder, consumer) pair, matched in order):
every fetched tensor arrives bit for bit, in any order of layers and rounds."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fusegen.engine.parallel.peer import PeerChannel, payload_pairs

# three ranks: rank 0 fetches layer 1 from rank 1; rank 2 fetches layers 4 and 5 from
# ranks 0 and 1; rank 1 fetches layer 2 from rank 2
HOLDERS = {0: {1: 1}, 1: {2: 2}, 2: {4: 0, 5: 1}}


def _tensors(consumer: int, layer: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * consumer + layer)
    return [torch.randn(5, 7, generator=g), torch.randint(-9, 9, (3,), generator=g,
                                                          dtype=torch.int8),
            torch.randn(4, generator=g).to(torch.bfloat16)]


def _rank(rank: int, world: int, init: str, backend, results) -> None:
    device = torch.device("cpu")
    if backend == "nccl":  # a CUDA device group: one GPU a rank, NCCL the default
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if backend == "nccl" else "gloo", init_method=init,
                            rank=rank, world_size=world)
    backend = None if backend == "nccl" else backend  # join picks NCCL by itself
    holders = HOLDERS[rank]
    consumers = {c for c, own in HOLDERS.items() for h in own.values() if h == rank}
    channel = PeerChannel.join(world, holders, consumers, payload_backend=backend)
    for consumer, own in HOLDERS.items():
        for layer, holder in own.items():
            if holder == rank:
                channel.held[(consumer, layer)] = _tensors(consumer, layer)
    channel.start()
    got = {}
    for round_ in range(3):  # layers in turn, tensors asked for before any is waited on
        for layer in sorted(holders, reverse=round_ % 2 == 1):
            targets = [torch.empty_like(t, device=device) for t in _tensors(rank, layer)]
            waits = [channel.fetch(layer, k, t) for k, t in enumerate(targets)]
            for wait in waits:
                wait()
            got[(round_, layer)] = [t.cpu() for t in targets]  # .cpu() waits on the stream
    channel.close()
    held_on = {str(t.device) for ts in channel.held.values() for t in ts}
    results[rank] = (got, sorted(channel.payload_groups), channel.bytes_fetched,
                     channel.bytes_served, held_on)
    dist.destroy_process_group()


NCCL = pytest.param("nccl", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 3, reason="needs three CUDA GPUs"))


@pytest.mark.parametrize("backend", [None, "gloo", NCCL])
def test_fetches_arrive_bit_for_bit(tmp_path, backend):
    world = 3
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(world, f"file://{tmp_path}/init", backend, results), nprocs=world)
    sizes = {}
    for rank in range(world):
        got, pairs, fetched, served, held_on = results[rank]
        assert held_on == ({f"cuda:{rank}"} if backend == "nccl" else {"cpu"})
        for (round_, layer), tensors in got.items():
            for a, b in zip(tensors, _tensors(rank, layer)):
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8),
                                                          b.view(torch.uint8))
        assert len(got) == 3 * len(HOLDERS[rank])
        sizes[rank] = (fetched, served)
        expected = [] if backend is None else sorted(
            p for p in [(1, 0), (2, 1), (0, 2), (1, 2)] if rank in p)
        assert pairs == expected
    one = sum(t.numel() * t.element_size() for t in _tensors(0, 0))  # 140 + 3 + 8 bytes
    assert one == 151
    assert sizes == {0: (3 * one, 3 * one), 1: (3 * one, 6 * one), 2: (6 * one, 3 * one)}


def test_payload_pairs_are_one_order_for_every_rank():
    every = [[(1, 0)], [(2, 1)], [(0, 2), (1, 2)]]
    assert payload_pairs(every) == [(0, 2), (1, 0), (1, 2), (2, 1)]
    assert payload_pairs(every[::-1]) == payload_pairs(every)
