"""JobSpec validation, YAML loading, flag overrides, fingerprint."""
import os

import pytest

from fusegen.jobs.errors import JobError
from fusegen.jobs.spec import JobSpec, build_spec, load_job_file


def _spec(**kw):
    return JobSpec(**{"model": "/m", "input": "in.parquet", "output": "out", **kw})


def test_defaults_and_sampling_params():
    spec = _spec(stop="END")
    assert spec.sampling.stop == ["END"]
    p = spec.sampling_params()
    assert (p.max_tokens, p.temperature, p.seed, p.stop) == (64, 1.0, 0, ["END"])


@pytest.mark.parametrize("kw, fragment", [
    ({"partition_rows": 0}, "partition_rows must be an integer >= 1"),
    ({"workers": True}, "workers must be an integer"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"progress": "loud"}, "progress must be one of"),
    ({"prompt_column": "generated_text"}, "is an output column name"),
    ({"model": ""}, "model is required: pass --model"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory: cannot read 'lots'"),
    ({"kv_cache_memory": "0"}, "kv_cache_memory must be an integer >= 1"),
])
def test_invalid_values_name_the_field(kw, fragment):
    with pytest.raises(JobError, match=None) as info:
        _spec(**kw)
    assert fragment in str(info.value)


def test_yaml_file_with_flag_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: ./m\ninput: in.parquet\noutput: out\nmax-tokens: 8\n"
                    "temperature: 0\nstorage_options: {anon: true}\n")
    spec = build_spec(load_job_file(str(path)), {"max_tokens": 3, "temperature": None})
    assert spec.sampling.max_tokens == 3 and spec.sampling.temperature == 0
    assert spec.storage_options == {"anon": True}
    assert spec.model == os.path.abspath("m")


def test_yaml_unknown_key_lists_valid_keys(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: m\nmax_token: 8\n")
    with pytest.raises(JobError, match="unknown key.*max_token; valid keys: model"):
        load_job_file(str(path))


def test_missing_required_field_says_how_to_pass_it():
    with pytest.raises(JobError, match="input is required: pass --input"):
        build_spec({"model": "m", "output": "o"})


def test_fingerprint_tracks_output_config_only():
    a = _spec().fingerprint([{"path": "/x", "num_rows": 3}])
    assert a == _spec(max_num_seqs=4, scheduler="tcp://h:1", overwrite=True).fingerprint(
        [{"path": "/x", "num_rows": 3}])
    assert a != _spec(max_tokens=5).fingerprint([{"path": "/x", "num_rows": 3}])
    assert a != _spec().fingerprint([{"path": "/x", "num_rows": 4}])


def test_repr_and_public_dict_hide_credentials():
    spec = _spec(input="s3://AKIDEXAMPLE:s3cr3tpass@bucket/in",
                 storage_options={"key": "AKIDEXAMPLE", "secret": "s3cr3tpass",
                                  "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}})
    text = repr(spec) + str(spec.public_dict())
    assert "s3cr3tpass" not in text and "AKIDEXAMPLE" not in text
    assert "http://127.0.0.1:1" in text


def test_kv_cache_memory_takes_sizes():
    assert _spec(kv_cache_memory="16MiB").engine.kv_cache_memory == 16 << 20
    assert _spec(kv_cache_memory=4096).engine.kv_cache_memory == 4096
