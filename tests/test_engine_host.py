"""engine/host.py: the allocator settings a CPU engine makes for itself."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusegen.engine.host import HUGE_PAGE, advise_huge_pages, keep_freed_memory, zeros_lazy

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold `tensor`'s memory (/proc/self/smaps)."""
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            start, end = (int(x, 16) for x in head.groups())
            inside = start < hi and end > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _THP.is_file()
                    or "[never]" in _THP.read_text(),
                    reason="transparent huge pages are off or absent on this machine")
def test_kv_cache_memory_gets_huge_pages():
    cache = zeros_lazy((8, 256, 2, 16, 4, 64), torch.float32, huge=True)  # 64 MiB
    assert cache.count_nonzero() == 0
    cache.fill_(0.5)  # the engine writing keys and values
    # The kernel may lack free 2 MiB frames on a busy machine; most of the span should not.
    assert _huge_bytes(cache) >= 16 * HUGE_PAGE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the lazy pool is Linux's")
def test_the_kv_pool_stays_on_small_pages_unless_asked():
    """The engine's pool (huge pages cost more to fault in than they gain on many
    machines): zeroed, lazily faulted, no huge pages asked for."""
    cache = zeros_lazy((8, 256, 2, 16, 4, 64), torch.float32)
    assert cache.shape == (8, 256, 2, 16, 4, 64) and cache.count_nonzero() == 0
    cache.fill_(0.5)
    if _THP.is_file() and "[madvise]" in _THP.read_text():  # ("always" gives them anyway)
        assert _huge_bytes(cache) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the lazy pool is Linux's")
def test_a_kv_pool_costs_memory_only_where_written():
    before = _resident_bytes()
    cache = zeros_lazy((2**30 // 4,), torch.float32)  # 1 GiB
    cache[:2**20] = 1.0  # 4 MiB written
    grown = _resident_bytes() - before
    assert grown < 64 * 2**20, f"a 1 GiB pool made the process grow by {grown} bytes"
    assert cache.sum() == 2**20


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_advise_refuses_what_holds_no_whole_huge_page():
    assert not advise_huge_pages(torch.empty(1000))


def test_freed_memory_kept_on_glibc():
    assert keep_freed_memory() is (sys.platform.startswith("linux") and
                                   "glibc" in " ".join(__import__("platform").libc_ver()))


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or "glibc" not in " ".join(__import__("platform").libc_ver()),
                    reason="glibc's arenas")
def test_threads_after_import_share_the_main_arena():
    # A thread's arena is chosen at its first allocation; `import fusegen` limits them
    # to one before torch and numpy start threads, so an engine thread allocating
    # activations of 2,048-token steps uses the main arena, not 64 MiB heaps of its own.
    code = """
import ctypes, threading
import fusegen, torch
def work():
    buffers = [torch.empty(12 * 2**20, dtype=torch.uint8) for _ in range(8)]
    torch.ones(64, 64) @ torch.ones(64, 64)
threads = [threading.Thread(target=work) for _ in range(3)]
[t.start() for t in threads]; [t.join() for t in threads]
ctypes.CDLL(None).malloc_stats()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    arenas = [line for line in done.stderr.splitlines() if line.startswith("Arena ")]
    assert arenas == ["Arena 0:"], done.stderr
