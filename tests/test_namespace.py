"""fusegen installs as one `fusegen` package: a fresh environment with its wheel has no
top-level `engine`, `kernels`, `jobs` or `workflows` (names other packages use), and the
wheel ships the CPU kernels' C source."""
import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERIC = ("engine", "kernels", "jobs", "workflows")
# Importing nothing: find_spec only locates, so the venv needs none of fusegen's dependencies.
_PROBE = """
import importlib.util, json, sys
print(json.dumps({"generic": {n: importlib.util.find_spec(n) is not None for n in sys.argv[1:]},
                  "fusegen": importlib.util.find_spec("fusegen").origin}))
"""


def _build_wheel(tmp: Path) -> Path:
    """A wheel of the working tree, built from a copy so that the build leaves nothing
    (build/, *.egg-info) in the checkout."""
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "tests", "build", "dist", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", str(src), "-w", str(tmp / "wheel")], check=True, timeout=120)
    (wheel,) = (tmp / "wheel").glob("fusegen-*.whl")
    return wheel


def _venv_with(wheel: Path, tmp: Path) -> Path:
    """A fresh venv (no pip, no system site-packages) with the wheel unzipped into it."""
    venv.EnvBuilder(with_pip=False).create(tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(purelib)
    return python


def test_a_fresh_venv_has_only_the_fusegen_namespace(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert {n.split("/", 1)[0] for n in names} == {"fusegen", "fusegen-0.1.0.dist-info"}
    # the C sources and the headers they include: an installed package compiles them
    c_sources = sorted(p.name for p in (ROOT / "kernels" / "csrc").iterdir()
                       if p.suffix in (".c", ".h"))
    assert c_sources and sorted(n.rsplit("/", 1)[1] for n in names
                                if n.startswith("fusegen/kernels/csrc/")) == c_sources

    python = _venv_with(wheel, tmp_path)
    cwd = tmp_path / "elsewhere"  # not the repository: its folders would be importable
    cwd.mkdir()
    # -E: PYTHONPATH and friends ignored, so only the venv is searched
    out = subprocess.run([str(python), "-E", "-c", _PROBE, *GENERIC], cwd=cwd, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    found = json.loads(out)
    assert found["generic"] == dict.fromkeys(GENERIC, False)
    assert Path(found["fusegen"]).is_relative_to(tmp_path / "venv")


def test_every_public_name_is_there():
    # `from fusegen import *` and `fusegen.<name>` for each name the package lists
    import fusegen

    missing = [name for name in fusegen.__all__ if not hasattr(fusegen, name)]
    assert missing == []
    assert fusegen.EngineConfig.__name__ == "EngineConfig"
