"""fusegen.jobs: the job spec, Parquet I/O over fsspec, the Dask driver, the CLI.

The names below are what other fusegen packages (workflows) use; every other module
and name in here is internal. They load on first use (PEP 562 `__getattr__`), so
importing `fusegen.jobs.cli` for `fusegen --help` does not import Dask.
"""
import importlib

# exported name -> the module of fusegen.jobs that defines it
_EXPORTS = {
    "JobError": "errors",
    "JobSpec": "spec", "build_spec": "spec", "load_job_file": "spec",
    "FIELD_NAMES": "spec", "OUTPUT_COLUMNS": "spec", "MESSAGES_COLUMN": "spec",
    "run_job": "driver", "JobResult": "progress", "open_client": "cluster",
    "JobInterrupted": "interrupt",
    "setup_logging": "run_cmd",
    "Redactor": "redact", "redact_url": "redact",
    "PromptTemplate": "template",
    "Partition": "plan", "plan_partitions": "plan",
    "filesystem": "storage", "list_input_files": "storage", "read_partition": "storage",
    "Output": "output", "PartStats": "output", "output_fingerprint": "output",
    "input_records": "output",
    "output_table": "parts",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # also how `from fusegen.jobs import engines` finds a submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
