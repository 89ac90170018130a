"""The `fusegen` command line: one click group; each command lives in its own module."""
import importlib

import click

# command name -> "module:attribute"; imported lazily so `fusegen --help` stays fast
# and a command's heavy dependencies load only when it runs.
_COMMANDS = {
    "run": "fusegen.jobs.run_cmd:run",
    "demo": "fusegen.jobs.demo:demo",
    "bench": "fusegen.jobs.bench_cmd:bench",
    "perplexity": "fusegen.jobs.bench.perplexity:perplexity",
    "quantize": "fusegen.jobs.quantize_cmd:quantize",
    "sparsify": "fusegen.jobs.sparsify_cmd:sparsify",
    "workflow": "fusegen.workflows.cli:workflow",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(_COMMANDS)

    def get_command(self, ctx, name):
        target = _COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=_LazyGroup)
@click.version_option(package_name="fusegen")
def main():
    """fusegen: batch offline inference for large language models."""


if __name__ == "__main__":
    main()
