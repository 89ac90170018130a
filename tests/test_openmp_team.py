"""kernels/openmp.py: a caller's OpenMP team is freed where it hands work to an engine.

A thread's team is seen as its worker threads in /proc/self/task: a parallel torch op
on a thread without a team adds one worker (two OpenMP threads: the caller and it), and
freeing the team makes that worker exit (asynchronously: polled for briefly)."""
import ctypes
import ctypes.util
import os
import sys
import threading
import time

import pytest
import torch

from fusegen import LLM, SamplingParams
from fusegen.kernels import native, openmp

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="threads are read from Linux's /proc/self/task")


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _parallel_op() -> None:
    torch.randn(512, 512) @ torch.randn(512, 512)


def _on_new_thread(fn, *args):
    """fn(*args) on a fresh thread (one with no team yet); its result, or its exception
    raised here."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - raised in the test
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _alive_after(tids: set[str], seconds: float = 5.0) -> set[str]:
    """Those of `tids` still running once they have exited, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while (alive := tids & _tids()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def _new_worker() -> str:
    """The worker a parallel op adds on the calling thread (which has no team)."""
    before = _tids()
    _parallel_op()
    added = _tids() - before
    assert len(added) == 1, f"a 2-thread parallel op added threads {added}"
    return added.pop()


@pytest.fixture
def two_threads(monkeypatch):
    """torch on 2 OpenMP threads, the C kernels loaded, and the process's one-time
    threads started (a first op on a passing thread, whose team ends with it)."""
    monkeypatch.delenv("FUSEGEN_KERNELS", raising=False)
    if native.library() is None:
        pytest.skip("the C kernels cannot be built here")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    _on_new_thread(_parallel_op)
    yield
    torch.set_num_threads(threads)


def test_release_frees_the_calling_threads_team(two_threads):
    def scenario():
        worker = _new_worker()
        released = openmp.release_thread_team()
        return worker, released, _alive_after({worker})

    worker, released, alive = _on_new_thread(scenario)
    assert released is True
    assert alive == set(), f"worker {worker} of the released team still runs"


def test_release_without_a_team_changes_nothing(two_threads):
    def scenario():
        before = _tids()
        return openmp.release_thread_team(), _tids() - before

    assert _on_new_thread(scenario) == (True, set())


def _left_after_release(engine_thread: bool = False) -> tuple[bool, set[str]]:
    """On a fresh thread (marked as an engine's where asked): a parallel op, then
    release_thread_team(); its answer, and the op's worker if it still runs 0.2 s on
    (the time a released one has to exit). The team ends with the thread."""
    def scenario():
        if engine_thread:
            openmp.mark_engine_thread()
        worker = _new_worker()
        released = openmp.release_thread_team()
        time.sleep(0.2)
        return released, {worker} & _tids()

    return _on_new_thread(scenario)


def test_reference_kernels_leave_the_team(two_threads, monkeypatch):
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    released, alive = _left_after_release()
    assert released is False and len(alive) == 1


def test_a_runtime_without_the_symbol_leaves_the_team(two_threads, monkeypatch):
    # looked up as release_thread_team does, through a library not linked to OpenMP
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    assert openmp._pause_in(libm) is None
    monkeypatch.setattr(openmp, "_pause_function", lambda: openmp._pause_in(libm))
    released, alive = _left_after_release()
    assert released is False and len(alive) == 1


def test_an_engine_thread_keeps_its_team(two_threads):
    released, alive = _left_after_release(engine_thread=True)
    assert released is False and len(alive) == 1


def test_the_kernels_runtime_is_torchs():
    """The symbol comes through the kernels' handle from the runtime torch loaded: one
    runtime in the process, whose pool the caller's torch ops filled."""
    if native.library() is None:
        pytest.skip("the C kernels cannot be built here")
    pause = openmp._pause_in(native.library())
    process = ctypes.CDLL(None)
    if not hasattr(process, "omp_pause_resource_all"):
        pytest.skip("torch's OpenMP runtime is not in the global scope here")
    assert ctypes.cast(pause, ctypes.c_void_p).value == \
        ctypes.cast(process.omp_pause_resource_all, ctypes.c_void_p).value


def test_llm_frees_its_callers_team_at_construction_and_generate(two_threads, llama_dir):
    prompts = ["hello there", [5, 6, 7, 8]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def scenario():
        worker = _new_worker()  # the caller used torch before LLM(...)
        with LLM(str(llama_dir), dtype="float32") as llm:
            after_build = _alive_after({worker})
            plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]
            worker = _new_worker()  # and again between two calls
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]
            after_generate = _alive_after({worker})
            worker = _new_worker()  # the jobs' path: submit, then wait on the futures
            submitted = [f.result().outputs[0].token_ids for f in
                         llm.submit_many([(p, params) for p in prompts])]
            after_submit = _alive_after({worker})
        return after_build, plain, tokens, after_generate, submitted, after_submit

    after_build, plain, tokens, after_generate, submitted, after_submit = \
        _on_new_thread(scenario)
    assert after_build == set(), "the caller's worker outlived LLM(...)"
    assert after_generate == set(), "the caller's worker outlived generate()"
    assert after_submit == set(), "the caller's worker outlived submit_many()"
    assert tokens == plain and submitted == plain
    assert all(len(t) == 12 for t in plain)
