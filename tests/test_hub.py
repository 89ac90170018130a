"""Models by hub id, from a Hugging Face cache the tests lay out on disk (offline): the
`models--org--name/snapshots/<commit>/` + `refs/<name>` layout huggingface_hub writes."""
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from fusegen.engine import LLM, EngineConfig, EngineOptions, ModelLoadError, SamplingParams
from fusegen.engine.weights.hub import looks_like_hub_id, resolve_model
from fusegen.jobs.cli import main
from jobs_fixtures import tiny_model_dir

MAIN, V2 = "a" * 40, "b" * 40  # the two snapshots' commit hashes


def _snapshot(cache: Path, repo: str, commit: str, ref: str, source: Path) -> Path:
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    shutil.copytree(source, snap)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def second_model(tmp_path_factory) -> Path:
    """Other weights (another seed), same tokenizer: the v2 revision."""
    from fusegen.engine.models.synthetic import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("v2") / "model", seed=1)


@pytest.fixture
def hub(tmp_path, monkeypatch, second_model):
    """An offline hub cache holding org/tiny at main (seed 0) and at tag v2 (seed 1)."""
    cache = tmp_path / "hub-cache"
    snaps = {"main": _snapshot(cache, "org/tiny", MAIN, "main", Path(tiny_model_dir())),
             "v2": _snapshot(cache, "org/tiny", V2, "v2", second_model)}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # no local org/tiny folder: the name is a hub id
    return cache, snaps


@pytest.mark.parametrize("name, expected", [
    ("Qwen/Qwen2.5-0.5B-Instruct", True), ("org/tiny", True), ("a_b/c.d-e", True),
    ("gpt2", False), ("./org/tiny", False), ("../org/tiny", False), ("/abs/path", False),
    ("org/tiny/extra", False), ("org--x/y", False), ("org/x..y", False), ("org/.x", False),
    ("org/x.", False), ("s3://bucket/model", False), ("~/models", False), ("org/", False),
])
def test_what_looks_like_a_hub_id(name, expected):
    assert looks_like_hub_id(name) is expected


def test_a_hub_id_resolves_to_its_cached_snapshot_and_generates_like_the_folder(hub):
    cache, snaps = hub
    assert resolve_model("org/tiny") == str(snaps["main"])
    prompts, params = ["hello world", "the sea"], SamplingParams(max_tokens=6, temperature=0)
    with LLM("org/tiny", max_num_seqs=4) as by_name:
        assert (by_name.config.model, by_name.config.model_name) == (str(snaps["main"]),
                                                                     "org/tiny")
        named = [o.token_ids for o in by_name.generate(prompts, params)]
    with LLM(tiny_model_dir(), max_num_seqs=4) as by_path:
        assert named == [o.token_ids for o in by_path.generate(prompts, params)]


def test_hf_home_names_the_cache_too(hub, monkeypatch):
    cache, snaps = hub
    monkeypatch.delenv("HF_HUB_CACHE")
    home = cache.parent / "hf-home"
    home.mkdir()
    cache.rename(home / "hub")
    monkeypatch.setenv("HF_HOME", str(home))
    assert resolve_model("org/tiny") == str(home / "hub" / snaps["main"].relative_to(cache))


def test_a_revision_pins_another_snapshot(hub, second_model):
    cache, snaps = hub
    assert resolve_model("org/tiny", "v2") == str(snaps["v2"])
    assert resolve_model("org/tiny", V2) == str(snaps["v2"])  # by commit hash
    assert resolve_model("org/tiny", MAIN) == str(snaps["main"])
    config = EngineConfig.build("org/tiny", EngineOptions(revision="v2", max_num_seqs=4))
    assert (config.model, config.model_name) == (str(snaps["v2"]), "org/tiny")
    prompt, params = [5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0)
    with LLM("org/tiny", revision="v2", max_num_seqs=4) as v2:
        pinned = v2.generate(prompt, params)[0].token_ids
    with LLM(str(second_model), max_num_seqs=4) as seed1, \
            LLM("org/tiny", max_num_seqs=4) as main_:
        assert pinned == seed1.generate(prompt, params)[0].token_ids
        assert pinned != main_.generate(prompt, params)[0].token_ids


def test_offline_and_not_cached_names_the_id_the_cache_and_the_fix(hub):
    cache, _ = hub
    with pytest.raises(ModelLoadError) as err:
        LLM("org/absent")
    assert str(err.value) == (
        f"model org/absent is not in the hub cache {cache} and HF_HUB_OFFLINE is set; "
        "download it on a machine that can reach the hub (`hf download org/absent`) and copy "
        "that cache here, or set HF_HOME (or HF_HUB_CACHE) to a cache that holds it")
    with pytest.raises(ModelLoadError, match=r"^model org/tiny at revision v3 is not in the hub "
                       r"cache .*\(`hf download org/tiny --revision v3`\)"):
        resolve_model("org/tiny", "v3")


def test_a_missing_local_path_fails_as_a_local_path(hub, tmp_path):
    for name in ("./org/absent", str(tmp_path / "no-such-model"), "gpt2"):
        with pytest.raises(ModelLoadError) as err:
            LLM(name)
        assert str(err.value) == (f"model {name}: no such file or directory; pass a "
                                  "checkpoint directory, a .gguf file, or a Hugging Face hub "
                                  "id (org/name)")


def test_a_local_folder_wins_over_the_hub_and_refuses_a_revision(hub, tmp_path):
    local = tmp_path / "org" / "tiny"
    shutil.copytree(tiny_model_dir(), local)
    assert resolve_model("org/tiny") == "org/tiny"  # relative to the working directory
    with pytest.raises(ModelLoadError, match="^revision 'v2' was given but org/tiny is a "
                       "local path, which has no revisions"):
        resolve_model("org/tiny", "v2")


def test_a_cached_repo_without_config_is_not_a_checkpoint(hub, tmp_path):
    cache, _ = hub
    gguf_only = tmp_path / "gguf-only"
    gguf_only.mkdir()
    (gguf_only / "README.json").write_text("{}")
    _snapshot(cache, "org/gguf", MAIN, "main", gguf_only)
    with pytest.raises(ModelLoadError, match=r"^model org/gguf \(cached in .*\) has no "
                       r"config.json: .* download its .gguf file and pass that path"):
        resolve_model("org/gguf")


def test_a_job_keeps_the_name_and_records_the_snapshot(hub, tmp_path):
    cache, snaps = hub
    pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), tmp_path / "in.parquet")
    args = ["run", "--model", "org/tiny", "--revision", "v2", "--input", "in.parquet",
            "--output", "out", "--max-tokens", "3", "--progress", "none"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert (manifest["config"]["model"], manifest["config"]["revision"]) == ("org/tiny", "v2")
    (stats,) = manifest["runs"][-1]["engine_stats"]
    assert stats["model_path"] == str(snaps["v2"])
    missing = CliRunner().invoke(main, [*args[:2], "org/absent", *args[3:], "--overwrite"])
    assert missing.exit_code == 1
    assert "model org/absent at revision v2 is not in the hub cache" in missing.output


def test_a_workflow_step_keeps_a_hub_id_and_checks_it_offline(hub, tmp_path):
    pq.write_table(pa.table({"topic": ["a"]}), tmp_path / "topics.parquet")
    doc = {"name": "wf", "workdir": str(tmp_path / "work"), "steps": {"draft": {
        "input": "topics.parquet", "generate": {"model": "org/tiny", "prompt_column": "topic"}}}}
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(doc))
    assert CliRunner().invoke(main, ["workflow", "check", "wf.yaml"]).exit_code == 0
    doc["steps"]["draft"]["generate"]["model"] = "org/absent"
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["workflow", "check", "wf.yaml"])
    assert result.exit_code == 2
    assert "key 'generate.model': model org/absent is not in the hub cache" in result.output
