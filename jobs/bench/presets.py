"""Named benchmark shapes: the model, the workload and the baseline's batch size."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusegen.engine.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class PresetModel:
    """The model a benchmark counts FLOPs and bytes over, as config.json numbers: a
    preset's (a Llama-family shape as fusegen.engine.models.synthetic.build_checkpoint
    takes it) or a real checkpoint's (`jobs/bench/model.py`, `shape_of`). Not the
    engine's `ModelShape` (engine/memory), which is the plan's sizes in parameters."""
    arch: str  # config.json's model_type; "llama": the synthetic builder's LlamaForCausalLM
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU: gate, up [hidden -> intermediate], down [intermediate -> hidden]
    num_layers: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention: num_heads % num_kv_heads == 0
    head_dim: int
    max_position_embeddings: int  # must hold the longest prompt + output of the workload
    tie_word_embeddings: bool = False
    # The checkpoint's stored dtype (the run may load it as another); "auto": none of
    # torch's (a GGUF file's quantized blocks).
    dtype: str = "bfloat16"
    # A mixture-of-experts MLP in every layer (a real --model's; 0 experts: dense): each
    # token runs through num_experts_per_tok experts of moe_intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def model_config(self) -> ModelConfig:
        """The engine's config of a model of these numbers, for its architecture's tensor
        tables (`engine/models`: what a checkpoint of it holds). Biases off, as the
        presets' checkpoints have them; a real model's biases are not among the numbers."""
        from fusegen.engine.models import SUPPORTED_ARCHITECTURES, get_architecture
        from fusegen.engine.models.config import ModelConfig

        by_type = {get_architecture(name).model_type: name for name in SUPPORTED_ARCHITECTURES}
        if self.arch not in by_type:
            raise ValueError(f"model arch {self.arch!r} is none fusegen runs; one of "
                             f"{', '.join(sorted(by_type))}")
        from fusegen.engine.models.moe import MoeArchitecture

        if self.num_experts and not isinstance(get_architecture(by_type[self.arch]),
                                               MoeArchitecture):
            raise ValueError(f"model arch {self.arch!r} has no mixture of experts; "
                             f"num_experts {self.num_experts} needs one that does")
        return ModelConfig(
            architecture=by_type[self.arch], vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=1e-6,
            rope_theta=10000.0, rope_scaling=None,
            tie_word_embeddings=self.tie_word_embeddings, qkv_bias=False, o_bias=False,
            mlp_bias=False, sliding_window=0, bos_token_id=None, eos_token_ids=[],
            torch_dtype=self.dtype, num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Integer lengths: uniform in [low, high], or log-normal with a given mean clipped to it."""
    kind: str  # "uniform" or "lognormal"
    low: int
    high: int
    mean: float = 0.0  # lognormal only: the mean before clipping
    sigma: float = 0.0  # lognormal only: the spread of log(length); ~1 gives ShareGPT-like tails

    def __post_init__(self):
        if self.kind not in ("uniform", "lognormal"):
            raise ValueError(f"length distribution kind must be uniform or lognormal, got {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length bounds need 1 <= low <= high, got {self.low}..{self.high}")
        if self.kind == "lognormal" and (self.mean <= 0 or self.sigma <= 0):
            raise ValueError("a lognormal length distribution needs mean > 0 and sigma > 0")

    def describe(self) -> str:
        if self.kind == "uniform" and self.low == self.high:
            return f"fixed {self.low}"
        if self.kind == "uniform":
            return f"uniform {self.low}..{self.high}"
        return f"lognormal mean~{self.mean:g} sigma {self.sigma:g}, clipped to {self.low}..{self.high}"


@dataclass(frozen=True, slots=True)
class OffloadSpec:
    """Memory budgets for the offload presets; fusegen and the accelerate baseline get
    the same ones."""
    resident_fraction: float | None = None  # device budget that keeps this share of layers
    device_memory: str | None = None  # or an explicit device budget, e.g. "24GiB"
    host_memory: str = "0"  # "0": streamed layers stay on disk (memory-mapped)


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    model: PresetModel
    num_requests: int
    prompt_len: LengthDist
    output_len: LengthDist
    hf_batch_size: int = 32
    quick_ceiling: bool = False  # small, short ceiling measurements (the test preset)
    # The run's dtype; "auto" is the engine's choice for the device: bf16 on GPUs and on
    # CPUs with bf16 matrix units (AMX / avx512_bf16), fp32 on CPUs without them, where
    # bf16 matmuls are emulated several times slower than fp32.
    run_dtype: str | None = None  # None: the checkpoint's dtype
    offload: OffloadSpec | None = None
    # "random": random prompt ids; "chat": the built-in chat prompts (chat_prompts.py) in
    # the model's chat template, so the model must be a real one with a tokenizer.
    prompts: str = "random"
    # The real model it runs when --model is not given (jobs/bench/model.py names);
    # None: a random checkpoint of `model`'s shape.
    default_model: str | None = None
    # Leading prompt tokens every request shares (an instruction), before the prompt_len
    # tokens of its own: what prefix caching serves.
    shared_prefix_len: int = 0
    # The named workload (WORKLOADS) that gave the requests; None: the preset's own.
    workload: str | None = None

    def __post_init__(self):
        if self.prompts not in ("random", "chat"):
            raise ValueError(f"preset {self.name}: prompts must be 'random' or 'chat', "
                             f"got {self.prompts!r}")

    def shrink(self, *, num_layers: int | None = None, num_requests: int | None = None,
               hf_batch_size: int | None = None) -> "Preset":
        """The same preset with fewer layers / requests (a smaller run of the same shape)."""
        model = self.model if num_layers is None else replace(self.model, num_layers=num_layers)
        return replace(
            self, model=model,
            num_requests=self.num_requests if num_requests is None else num_requests,
            hf_batch_size=self.hf_batch_size if hf_batch_size is None else hf_batch_size)

    def with_workload(self, name: str) -> "Preset":
        """The same model on the named workload's requests (random prompt ids, no shared
        prefix). The preset's random model gets the positions the longest request needs
        (a RoPE model's positions hold no weights); a real model keeps its own, and
        BenchConfig refuses a workload it cannot hold."""
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
        work = WORKLOADS[name]
        positions = max(self.model.max_position_embeddings, work.max_context)
        return replace(self, model=replace(self.model, max_position_embeddings=positions),
                       num_requests=work.num_requests, prompt_len=work.prompt_len,
                       output_len=work.output_len, prompts="random", shared_prefix_len=0,
                       workload=name)


@dataclass(frozen=True, slots=True)
class Workload:
    """Request lengths apart from any model, shaped like a published benchmark's: what
    `fusegen bench --workload` puts on a preset."""
    name: str
    num_requests: int  # the default; --requests overrides it
    prompt_len: LengthDist
    output_len: LengthDist
    about: str  # where the lengths come from

    @property
    def max_context(self) -> int:
        return self.prompt_len.high + self.output_len.high

    def describe(self) -> str:
        return (f"{self.name}: {self.num_requests:,} requests, prompts "
                f"{self.prompt_len.describe()}, outputs {self.output_len.describe()}; "
                f"{self.about}")


WORKLOADS: dict[str, Workload] = {
    # Lengths after ShareGPT as the field benchmarks it (vLLM's and SGLang's ShareGPT
    # runs, vLLM's published ~8.1k tok/s on an H100): prompt mean ~200 and output mean
    # ~180 with long tails, capped at 1024 each (as vLLM's script does).
    "sharegpt-like": Workload(
        "sharegpt-like", 1000,
        prompt_len=LengthDist("lognormal", 4, 1024, mean=200.0, sigma=1.0),
        output_len=LengthDist("lognormal", 4, 1024, mean=180.0, sigma=0.9),
        about="ShareGPT's lengths, long-tailed, each capped at 1024 as vLLM's "
              "benchmark caps them; random prompt ids"),
    # Fixed lengths, as the random-dataset runs of vLLM's and SGLang's benchmarks at
    # 1024 / 1024; TensorRT-LLM's table uses 1000 / 1000 (the gpu-8b-1k preset).
    "random-1k-1k": Workload(
        "random-1k-1k", 1000,
        prompt_len=LengthDist("uniform", 1024, 1024),
        output_len=LengthDist("uniform", 1024, 1024),
        about="exactly 1024 random prompt ids and 1024 output tokens a request, EOS "
              "ignored, as the random-dataset runs of vLLM's and SGLang's benchmarks"),
}

PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        model=PresetModel(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         max_position_embeddings=128, dtype="float32"),
        num_requests=12,
        prompt_len=LengthDist("uniform", 2, 24),
        output_len=LengthDist("uniform", 1, 12),
        hf_batch_size=4,
        quick_ceiling=True,
    ),
    "cpu-small": Preset(
        name="cpu-small",
        model=PresetModel(arch="llama", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                         num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                         max_position_embeddings=1024, dtype="bfloat16"),
        num_requests=256,
        prompt_len=LengthDist("uniform", 16, 512),
        output_len=LengthDist("uniform", 16, 256),
        hf_batch_size=32,
        run_dtype="auto",
    ),
    # Llama-3-8B's shape on the sharegpt-like workload.
    "gpu-8b": Preset(
        name="gpu-8b",
        model=PresetModel(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                         max_position_embeddings=4096, dtype="bfloat16"),
        num_requests=1000,
        prompt_len=WORKLOADS["sharegpt-like"].prompt_len,
        output_len=WORKLOADS["sharegpt-like"].output_len,
        hf_batch_size=64,
        workload="sharegpt-like",
    ),
    # A 32B Llama shape (~65 GB in bf16), about twice a 24 GiB device budget: most
    # layers stream from pinned host memory.
    "gpu-offload": Preset(
        name="gpu-offload",
        model=PresetModel(arch="llama", vocab_size=152064, hidden_size=5120,
                         intermediate_size=27648, num_layers=64, num_heads=40, num_kv_heads=8,
                         head_dim=128, max_position_embeddings=4096, dtype="bfloat16"),
        num_requests=512,
        prompt_len=WORKLOADS["sharegpt-like"].prompt_len,
        output_len=WORKLOADS["sharegpt-like"].output_len,
        hf_batch_size=32,
        workload="sharegpt-like",
        offload=OffloadSpec(device_memory="24GiB", host_memory="100GiB"),
    ),
}
# Chat traffic on a real model, SmolLM2-135M-Instruct by default (`model` is its shape;
# a run reads the shape of the model it loads): the built-in chat prompts in the model's
# chat template, lengths like chat requests (30..600 tokens, mean ~200), answers of
# 32..256 tokens (mean ~120).
PRESETS["chat"] = Preset(
    name="chat",
    model=PresetModel(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                     max_position_embeddings=8192, tie_word_embeddings=True, dtype="auto"),
    num_requests=64,
    prompt_len=LengthDist("lognormal", 30, 600, mean=200.0, sigma=0.8),
    output_len=LengthDist("lognormal", 32, 256, mean=120.0, sigma=0.6),
    hf_batch_size=16,
    run_dtype="auto",
    prompts="chat",
    default_model="smollm2",
)
# cpu-small with a device budget that holds a quarter of its layers beside the KV cache
# of the whole workload; the rest stream from disk (the memory-mapped checkpoint), as
# accelerate's offload does on a CPU.
PRESETS["cpu-offload"] = replace(
    PRESETS["cpu-small"], name="cpu-offload",
    offload=OffloadSpec(resident_fraction=0.25, host_memory="0"))
# Prefill-heavy: cpu-small's model on 64 prompts of exactly 1024 tokens, 128 outputs each
# (positions up to 2048, so 1024 + 128 fits).
PRESETS["cpu-prefill"] = replace(
    PRESETS["cpu-small"], name="cpu-prefill",
    model=replace(PRESETS["cpu-small"].model, max_position_embeddings=2048),
    num_requests=64, prompt_len=LengthDist("uniform", 1024, 1024),
    output_len=LengthDist("uniform", 128, 128), hf_batch_size=16)
# A labelling job: cpu-small's model on 512 rows sharing a 1,024-token instruction, each
# with 32..128 tokens of its own and a 32-token answer (positions up to 2048 hold
# 1024 + 128 + 32). Run it with --prefix-caching both to see what the cache saves.
PRESETS["labelling"] = replace(
    PRESETS["cpu-small"], name="labelling",
    model=replace(PRESETS["cpu-small"].model, max_position_embeddings=2048),
    num_requests=512, shared_prefix_len=1024, prompt_len=LengthDist("uniform", 32, 128),
    output_len=LengthDist("uniform", 32, 32), hf_batch_size=16)
# gpu-8b's model on the fixed lengths of TensorRT-LLM's published table (1,000 prompt
# and 1,000 output tokens a request): the anchor a GPU user compares with.
PRESETS["gpu-8b-1k"] = replace(
    PRESETS["gpu-8b"], name="gpu-8b-1k", num_requests=512,
    prompt_len=LengthDist("uniform", 1000, 1000), output_len=LengthDist("uniform", 1000, 1000))
