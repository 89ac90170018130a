"""`fusegen bench`: fusegen beside vLLM, transformers and the machine's own ceiling.

presets.py (shapes) -> workload.py, chat_prompts.py (seeded requests: random ids or
chat-templated prompts) -> checkpoint.py (cached random model), or model.py (a real
--model; a GGUF file's export for the baselines; with --sparsity, the model pruned
to each sparsity, sparse.py's variants) -> ceiling.py (matmul FLOP/s,
bandwidth) -> fusegen_runner.py, vllm_runner.py (vLLM in its own interpreter, running
vllm_child.py), hf_static.py, hf_continuous.py (the engines) -> flops.py (model FLOPs
and bytes) -> report.py (JSON and table; sparse.py's figures of the pruned runs) ->
html_report.py (the HTML page, drawn with jobs/svg.py); harness.py runs them in that
order, bench_cmd.py writes the page.
"""
