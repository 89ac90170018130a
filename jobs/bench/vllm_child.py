"""Runs inside the vLLM interpreter that `fusegen bench --vllm-python PATH` names.

usage: PATH vllm_child.py JOB.json RESULT.json

That interpreter is a separate environment, so this script imports only the standard
library and vllm: nothing of fusegen. The job file holds the model directory, dtype,
max_model_len, seed, max_num_seqs (null: vLLM's own default) and the requests
({"prompt_ids": [...], "max_tokens": n}, timed ones and warm-up ones). The result file
holds the vllm version, the load and timed seconds and, per request, what vLLM produced;
on failure, the error instead. Exit status 0 when it ran, 1 when it failed.
"""
import json
import os
import sys
import time
import traceback

# Run by path, the script's own folder (fusegen's bench modules: report.py, results.py,
# ...) heads sys.path; none of it may shadow a module vLLM imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

_TRACEBACK_LINES = 20


def _prompts_and_params(vllm, requests):
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests]
    # Greedy and ignore_eos, as every engine of the benchmark runs: exactly the budget.
    params = [vllm.SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
              for r in requests]
    return prompts, params


def _generate(llm, vllm, requests):
    prompts, params = _prompts_and_params(vllm, requests)
    return llm.generate(prompts, params, use_tqdm=False)


def _describe(output) -> dict:
    completion = output.outputs[0]
    return {"num_prompt_tokens": len(output.prompt_token_ids),
            "num_output_tokens": len(completion.token_ids),
            "finish_reason": completion.finish_reason}


def run(job: dict) -> dict:
    import vllm

    options = {"model": job["model"], "dtype": job["dtype"],
               "max_model_len": job["max_model_len"], "seed": job["seed"]}
    if job.get("max_num_seqs"):
        options["max_num_seqs"] = job["max_num_seqs"]
    start = time.perf_counter()
    llm = vllm.LLM(**options)
    load_s = time.perf_counter() - start
    _generate(llm, vllm, job["warmup"])  # untimed, as fusegen's warm-up
    start = time.perf_counter()
    outputs = _generate(llm, vllm, job["requests"])
    elapsed_s = time.perf_counter() - start
    return {"vllm_version": getattr(vllm, "__version__", "unknown"), "load_s": load_s,
            "elapsed_s": elapsed_s, "outputs": [_describe(o) for o in outputs]}


def _error(exc: BaseException) -> dict:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(lines).splitlines()[-_TRACEBACK_LINES:]
    return {"error": {"type": type(exc).__name__, "message": str(exc), "traceback": tail}}


def main(argv) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} JOB.json RESULT.json", file=sys.stderr)
        return 2
    job_path, result_path = argv[1], argv[2]
    try:
        with open(job_path) as f:
            result = run(json.load(f))
        status = 0
    except BaseException as exc:  # anything vLLM raises is the benchmark's answer
        traceback.print_exc()
        result, status = _error(exc), 1
    with open(result_path, "w") as f:
        json.dump(result, f)
    return status


# vLLM starts its engine in spawned processes, which import this file again: the guard
# keeps them from running the job a second time.
if __name__ == "__main__":
    sys.exit(main(sys.argv))
