"""fusegen: batch offline inference for large transformer language models."""
from setuptools import find_packages, setup

_PACKAGES = find_packages(include=["engine*", "kernels*", "jobs*", "workflows*"])

setup(
    name="fusegen",
    version="0.1.0",
    description="Batch offline LLM inference: Dask streams Parquet prompts through a "
    "temporally fused generation engine with a heterogeneous memory pool.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The folders stay at the repository root; they install under one `fusegen`
    # namespace (the root's __init__.py is `fusegen`), so fusegen never puts generic
    # top-level modules (`engine`, `kernels`, ...: names other packages use) into an
    # environment.
    package_dir={"fusegen": "."},
    packages=["fusegen", *(f"fusegen.{p}" for p in _PACKAGES)],
    # The CPU kernels' C source is compiled on first use (kernels/native.py), so it
    # ships as data: installing fusegen needs no compiler.
    # py.typed: type checkers read fusegen's annotations (PEP 561).
    package_data={"fusegen": ["py.typed"], "fusegen.kernels": ["csrc/*.c", "csrc/*.h"]},
    install_requires=[
        # A range, never a pin: on a CPU-only machine install the CPU build first
        # (`pip install torch==2.13.0`) and this range keeps pip from replacing it.
        "torch>=2.4",
        "triton; platform_system == 'Linux'",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "dask[distributed,dataframe]>=2024.6",
        "pyarrow>=15",
        "fsspec>=2024.3",
        "click>=8.1",
        "jinja2>=3.1",  # prompt templates and tokenizer chat templates
        "pyyaml>=6",  # job and workflow files
        "croniter>=2.0",  # workflow schedules: cron parsing with time zones
        "psutil>=5.9",  # machine-derived defaults (free host memory)
        # Models named by hub id (org/name): the Hugging Face cache, downloads, revisions.
        "huggingface_hub>=0.23",
        # GGUF checkpoints (`LLM("model.gguf")`): the format's own library, for its type
        # table, its dequantizers and its tensor-name tables (0.17 on: qwen3, gemma3).
        "gguf>=0.17",
        # LLM.generate(use_tqdm=True): the progress bar vLLM's offline API draws, so
        # scripts ported from it behave the same.
        "tqdm>=4.66",
    ],
    extras_require={
        # Reading and writing s3:// URLs.
        "s3": ["s3fs>=2024.3"],
        # The Dask dashboard of a job's cluster (`fusegen run` prints its address): Dask
        # serves it always, but draws its pages with bokeh (3.1 on: Dask's requirement),
        # which nothing else needs; without it a job says to install this extra.
        "dashboard": ["bokeh>=3.1"],
        # `fusegen bench` baselines: transformers `generate` and accelerate offload.
        "bench": ["transformers>=4.45", "accelerate>=0.30"],
        # Structured output (json_schema, regex, choice, grammar): llguidance. Of the
        # maintained grammar engines it is the one that installs alone (a Rust wheel, no
        # dependencies: xgrammar requires torch, transformers and triton; outlines-core
        # does no context-free grammars); it computes masks on the CPU into a bitmask that
        # any device applies; it refuses a schema keyword it does not implement instead of
        # ignoring it; and it is fast where it is paid, per token: on SmolLM2's 49,152-token
        # vocabulary a five-field JSON schema's mask takes a median of 23 us a token (40 us
        # with free whitespace; outlines-core 36 us after 178 ms building its index per
        # schema; xgrammar 14 us), under 1.5 ms to compile a schema. An extra, as most jobs
        # are unconstrained: without it a constrained request is an error naming this extra.
        "structured": ["llguidance>=1.9"],
        # The test suite: transformers is the token-exact reference; moto serves a
        # local S3 API for the storage tests.
        "test": [
            "pytest>=8",
            "transformers>=4.45",
            "accelerate>=0.30",
            "s3fs>=2024.3",
            "moto[server]>=5",
            "llguidance>=1.9",  # structured output
            "jsonschema>=4",  # validates structured outputs against their schemas
        ],
    },
    entry_points={"console_scripts": ["fusegen=fusegen.jobs.cli:main"]},
)
