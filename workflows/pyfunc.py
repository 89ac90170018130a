"""A python step's function: found, identified and applied to one partition.

`module:function` is imported with the workflow file's directory first on sys.path (on
the driver and on every worker), so `cleaners.py` beside the file is found; an installed
module is found as usual. The step's identity is the reference, the format and a SHA-256
of the module's file: editing that file reruns the step and every step after it. A
module already imported whose file changed since is reloaded, so a long-lived process
(a persistent Dask worker, the scheduler daemon) never runs code older than the file the
fingerprint names.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import os
import re
import sys
import threading
import traceback
from dataclasses import dataclass

import pyarrow as pa

from fusegen.workflows.errors import WorkflowError

FORMATS = ("arrow", "pandas")  # what the function receives and returns: a Table / DataFrame
_REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_LOCK = threading.Lock()  # worker threads import and reload one at a time
_LOADED: dict[str, str | None] = {}  # module name -> SHA-256 of the file it was loaded from


class FunctionError(ValueError):
    """The function cannot be found or called; one line naming module and function."""


def ref_problem(ref) -> str | None:
    """Why `ref` is not a `module:function` reference, or None."""
    if isinstance(ref, str) and _REF.fullmatch(ref):
        return None
    return (f"{ref!r} is not a function reference; write module:function, e.g. "
            "cleaners:strip_markup (cleaners.py beside the workflow file, or an installed "
            "module)")


@dataclass(frozen=True, slots=True)
class PythonFunction:
    ref: str  # module:function
    format: str = "arrow"  # one of FORMATS
    base_dir: str = ""  # the workflow file's directory: first on sys.path
    source_sha256: str | None = None  # of the module's file; None: it has none (builtin)

    @classmethod
    def find(cls, ref: str, fmt: str, base_dir: str) -> "PythonFunction":
        """The function as the driver finds it now; raises FunctionError."""
        _, sha = _load(ref, base_dir)
        return cls(ref, fmt, base_dir, sha)

    def config(self) -> dict:
        """What the step's output depends on (with its inputs): the fingerprint's config."""
        return {"python": self.ref, "format": self.format, "source_sha256": self.source_sha256}

    def load(self, step: str):
        """The callable, on a worker: the same file the driver hashed, or WorkflowError."""
        try:
            fn, sha = _load(self.ref, self.base_dir)
        except FunctionError as exc:
            raise WorkflowError(f"step {step!r}, on a worker: {exc}") from None
        if sha != self.source_sha256:
            module = self.ref.split(":")[0]
            raise WorkflowError(
                f"step {step!r}: the worker's module {module!r} ({_file_of(module)}) is not "
                f"the file the driver read for {self.ref}; install the same version on every "
                "worker, or keep it beside the workflow file on storage every worker reads")
        return fn

    def apply(self, fn, table: pa.Table, where: str) -> pa.Table:
        """fn over one partition, its return checked; `where` names step and partition."""
        batch = table.to_pandas() if self.format == "pandas" else table
        try:
            result = fn(batch)
        except Exception as exc:  # noqa: BLE001 - the user's code: any error fails the part
            raise WorkflowError(f"{where}: {self.ref} raised {_last_line(exc)}") from None
        return self._as_table(result, where)

    def _as_table(self, result, where: str) -> pa.Table:
        if self.format == "pandas":
            import pandas as pd

            if not isinstance(result, pd.DataFrame):
                raise WorkflowError(f"{where}: {self.ref} returned {_kind(result)}, not a "
                                    "pandas DataFrame (format: pandas)")
            try:
                table = pa.Table.from_pandas(result, preserve_index=False)
            except (pa.ArrowException, ValueError, TypeError) as exc:
                raise WorkflowError(f"{where}: the DataFrame {self.ref} returned does not "
                                    f"convert to Arrow: {str(exc).splitlines()[0]}") from None
            table = table.replace_schema_metadata(None)  # pandas' own: an index there is none of
        elif isinstance(result, pa.RecordBatch):
            table = pa.Table.from_batches([result])
        elif isinstance(result, pa.Table):
            table = result
        else:
            raise WorkflowError(f"{where}: {self.ref} returned {_kind(result)}, not a "
                                "pyarrow Table (format: arrow; `format: pandas` passes and "
                                "takes a DataFrame)")
        names = table.column_names
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise WorkflowError(f"{where}: {self.ref} returned two columns named "
                                f"{', '.join(map(repr, twice))}")
        return table


def _load(ref: str, base_dir: str):
    """(the callable, the SHA-256 of its module's file); raises FunctionError."""
    module_name, _, attr = ref.partition(":")
    with _LOCK:
        if base_dir:
            _put_first(base_dir, module_name)
        try:
            if module_name not in sys.modules:
                importlib.invalidate_caches()  # a file written since the path was listed
            module = importlib.import_module(module_name)
            sha = _sha(module)
            if module_name in _LOADED and _LOADED[module_name] != sha:
                module = importlib.reload(module)  # the file changed since it was imported
            _LOADED[module_name] = sha
        except ModuleNotFoundError as exc:
            where = f"beside the workflow file ({base_dir})" if base_dir else "on sys.path"
            raise FunctionError(f"cannot import module {module_name!r} for {ref}: {exc}; put "
                                f"{module_name.replace('.', '/')}.py {where} or install it "
                                "where the workers run") from None
        except Exception as exc:  # noqa: BLE001 - the module's own code failed
            raise FunctionError(f"importing module {module_name!r} for {ref} raised "
                                f"{_last_line(exc)}") from None
    obj = module
    for name in attr.split("."):
        if not hasattr(obj, name):
            defined = sorted(n for n, v in vars(module).items()
                             if callable(v) and not n.startswith("_"))
            raise FunctionError(f"module {module_name!r} ({_file_of(module_name)}) has no "
                                f"function {attr!r} for {ref}; it defines: "
                                f"{', '.join(defined) or 'no public functions'}")
        obj = getattr(obj, name)
    if not callable(obj):
        raise FunctionError(f"{ref} is {_kind(obj)}, not a function")
    return obj, sha


def _put_first(base_dir: str, module_name: str) -> None:
    """The workflow's directory first on sys.path, and a module of that name imported
    from elsewhere (another workflow's directory) forgotten, so this one's is imported."""
    if base_dir in sys.path:
        sys.path.remove(base_dir)
    sys.path.insert(0, base_dir)
    top = module_name.split(".")[0]
    loaded = sys.modules.get(top)
    spec = importlib.machinery.PathFinder.find_spec(top, [base_dir])
    if loaded is None or spec is None or spec.origin == getattr(loaded, "__file__", None):
        return
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]
        _LOADED.pop(name, None)


def _sha(module) -> str | None:
    path = getattr(module, "__file__", None)
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _file_of(module_name: str) -> str:
    module = sys.modules.get(module_name)
    return getattr(module, "__file__", None) or "built in"


def _kind(value) -> str:
    if value is None:
        return "None"
    t = type(value)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return f"a {name}"


def _last_line(exc: BaseException) -> str:
    """The traceback's last line, and where in the user's code it was raised."""
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{text} ({os.path.basename(exc.filename)}, line {exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen")]  # importlib's own frames
    if frames:
        last = frames[-1]
        text += f" ({os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return text
