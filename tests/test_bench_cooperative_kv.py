"""jobs/bench/cooperative_kv.py at tiny shapes on the CPU: every placement gives the same
greedy tokens, swapping swaps (its bytes: every block out and back), cooperative keeps the
batch without preemption and records its transfers and host parts, and bad arguments are
refused by name."""
import pytest

from fusegen.jobs.bench.cooperative_kv import BLOCK_BYTES, parse_args, run_benchmark


def test_tiny_run_counts_bytes_and_stalls(capsys):
    # 3 prompts of 16, 24, 32 tokens + 40 generated: the device holds 5 blocks (one
    # request of 72 tokens), all three prompts at first, then preempts as they grow;
    # cooperative's quota is 1 block each; the batch needs 4 + 4 + 5 = 13
    args = parse_args(["--device", "cpu", "--num-requests", "3", "--prompt-min", "16",
                       "--prompt-max", "32", "--max-tokens", "40", "--rounds", "1"])
    runs, same = run_benchmark(args)
    out = capsys.readouterr().out
    assert same and "greedy tokens identical across placements: True" in out
    assert "the batch needs 13, the device holds 5" in out
    swap, coop = runs["swap"][0], runs["cooperative"][0]
    assert swap.preempted > 0 and swap.swapped_blocks > 0
    assert swap.crossed_bytes == 2 * swap.swapped_blocks * BLOCK_BYTES
    assert runs["recompute"][0].crossed_bytes == 0 and runs["recompute"][0].preempted > 0
    assert coop.preempted == 0 and coop.swapped_blocks == 0
    assert coop.decode_batch == 3.0 > swap.decode_batch
    assert 0 < coop.crossed_bytes
    assert coop.stall_seconds > 0  # on a CPU the host parts run in the step's thread
    assert "bytes between device and host saved by cooperative against swap" in out


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        parse_args(["--placements", "swap,split"])
    with pytest.raises(SystemExit):
        parse_args(["--prompt-min", "100", "--prompt-max", "50"])
    assert parse_args(["--placements", "cooperative, swap"]).placements == ["cooperative", "swap"]
