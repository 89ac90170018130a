"""The runner contract (engine/runner_api.py): both runners declare it and define every
member themselves (none falls back to the protocol's empty body), and the engine, jobs
and the bench read a runner through it alone."""
import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from fusegen.engine import LLM, SamplingParams
from fusegen.engine.model_runner import ModelRunner
from fusegen.engine.parallel.parallel_runner import ParallelRunner
from fusegen.engine.runner_api import Runner

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = {"max_in_flight", "num_blocks", "num_host_blocks", "uses_request_lengths",
           "supports_prompt_logprobs", "streamer", "graphs", "failed", "submit", "collect",
           "memory_report", "step_weight_bytes", "local_model", "reset_streams", "close",
           "supports_async_scheduling", "overlap_steps"}


def protocol_members() -> set[str]:
    body = {n for n, v in vars(Runner).items()
            if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return body | set(Runner.__annotations__)


def own_members(cls) -> set[str]:
    """Members `cls` or a base below `Runner` defines: in a class body, or assigned
    to `self` in `__init__`."""
    found = set()
    for klass in cls.__mro__[:cls.__mro__.index(Runner)]:
        found |= set(vars(klass))
        init = ast.parse(textwrap.dedent(inspect.getsource(klass.__init__)))
        found |= {t.attr for node in ast.walk(init) if isinstance(node, (ast.Assign,
                                                                         ast.AnnAssign))
                  for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                  and t.value.id == "self"}
    return found


def test_the_contract_lists_what_its_readers_use():
    assert protocol_members() == MEMBERS


@pytest.mark.parametrize("cls", [ModelRunner, ParallelRunner])
def test_each_runner_declares_and_defines_the_whole_contract(cls):
    assert Runner in cls.__mro__  # declared, not merely matching
    assert MEMBERS - own_members(cls) == set()


@pytest.mark.parametrize("path", ["engine/llm_engine.py", "jobs/engines.py",
                                  "jobs/bench/fusegen_runner.py"])
def test_readers_probe_no_runner_attribute(path):
    # no getattr/hasattr on a runner, no isinstance against a runner class
    text = (ROOT / path).read_text()
    assert "getattr(llm.engine.runner" not in text and "getattr(runner" not in text
    assert "isinstance(self.runner" not in text and "hasattr(" not in text


def test_a_single_process_runner_hands_back_each_batch_as_submitted(llama_dir):
    # ModelRunner runs a batch on submit and collect returns its tokens; a failed step
    # leaves nothing to collect.
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM(str(llama_dir), dtype="float32", device="cpu") as llm:
        runner = llm.engine.runner
        assert (runner.supports_prompt_logprobs, runner.failed, runner.streamer,
                runner.uses_request_lengths) == (True, None, None, False)
        expected = [o.token_ids for o in llm.generate(["a b c", "d e"], params)]
        calls = []
        run = runner.run
        runner.run = lambda batch: calls.append("run") or run(batch)
        submit = runner.submit
        runner.submit = lambda batch: calls.append("submit") or submit(batch) \
            or calls.append("submitted")
        assert [o.token_ids for o in llm.generate(["a b c", "d e"], params)] == expected
        assert calls[:3] == ["submit", "run", "submitted"]
        runner._tokens.append([0])
        runner.reset_streams()
        assert not runner._tokens
        weights = sum(runner.memory[t]["weights"] for t in ("device", "host", "disk"))
        embed = runner.model.embed
        assert runner.step_weight_bytes() == weights - embed.numel() * embed.element_size()
