"""Workflow parameters that carry credentials: never in the run store, `workflow show`, the
failure hint or error messages; the run store file is the owner's only; a resume asks for
them again and then uses them."""
import os
import stat

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from fusegen.jobs.cli import main
from fusegen.workflows import steps as wf_steps
from fusegen.workflows.resolve import effective_params
from fusegen.workflows.spec import parse_workflow
from fusegen.workflows.store import open_store
from jobs_fixtures import read_output

RUN_DATE = "2024-05-01"
SECRET = "PW-cli-secret-42"
MASK = "***"


def _file(root) -> str:
    pq.write_table(pa.table({"id": list(range(6))}), root / "in.parquet")
    doc = {"name": "creds",
           "params": {"secret": "file-default-secret", "region": "eu-west-1", "n": 2},
           "workdir": "work/{{ run_date }}",
           "steps": {"keep": {"input": "in.parquet", "filter": "id % {{ n }} == 0",
                              "partition_rows": 2,
                              "storage_options": {"password": "{{ secret }}",
                                                  "region_name": "{{ region }}"}}}}
    path = root / "creds.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


@pytest.fixture
def seen_passwords(monkeypatch):
    """Fails every transform part with a message that quotes its storage options'
    password (as a backend error might), recording the password each part saw."""
    seen = []

    def leaky(step, *args):
        seen.append(step.storage_options["password"])
        raise OSError(f"access denied with {step.storage_options['password']}")

    monkeypatch.setattr(wf_steps, "_transform_part", leaky)
    return seen


def test_the_run_store_file_is_owner_only(tmp_path):
    store = open_store(tmp_path / "state" / "runs.db")
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600


def test_which_params_are_credentials():
    from fusegen.workflows.credentials import secret_params

    wf = parse_workflow({
        "name": "w", "params": {"secret": "s", "region": "eu", "n": 2, "api_token": "t",
                                "host_url": "x", "custom": "c", "bucket": "b"},
        "workdir": "work",
        "steps": {"a": {"input": "s3://{{ bucket }}/in", "filter": "id > {{ n }}",
                        "storage_options": {"password": "{{ secret }}",
                                            "region_name": "{{ region }}",
                                            "my_plugin": {"opt": "{{ custom }}"},
                                            "client_kwargs": {
                                                "endpoint_url": "http://{{ host_url }}@h"}}}}},
        "w.yaml")
    params = effective_params(wf, None)
    # password: secret key; my_plugin.opt: text under an unknown key; host_url: userinfo
    assert secret_params(wf, params, RUN_DATE) == {"secret", "custom", "host_url", "api_token"}
    params = effective_params(wf, {"region": "http://u:pw@proxy"})
    assert "region" in secret_params(wf, params, RUN_DATE)  # a value carrying a password


def test_credential_params_are_masked_everywhere_and_asked_for_on_resume(
        tmp_path, monkeypatch, seen_passwords):
    wf = _file(tmp_path)
    db = tmp_path / "state" / "runs.db"
    store = f"sqlite:///{db}"
    runner = CliRunner()
    failed = runner.invoke(main, ["workflow", "run", wf, "--param", f"secret={SECRET}",
                                  "--run-date", RUN_DATE, "--store", store])
    assert failed.exit_code == 1
    assert seen_passwords == [SECRET]
    assert SECRET not in failed.output
    assert f"step 'keep' failed: OSError: access denied with {MASK}" in failed.output
    assert (f"to continue where it stopped: fusegen workflow run {wf} --param secret={MASK} "
            f"--run-date {RUN_DATE} --store {store} (or fusegen workflow resume 1 "
            f"--param secret={MASK} --store {store}); {MASK} stands for the value you gave, "
            "which is not shown") in failed.output
    assert SECRET.encode() not in db.read_bytes()
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    run = open_store(store).run(1)
    assert run.params == {"n": 2, "region": "eu-west-1", "secret": MASK}
    assert SECRET not in run.error

    show = runner.invoke(main, ["workflow", "show", "1", "--store", store])
    assert show.exit_code == 0 and SECRET not in show.output
    assert "params: {'n': 2, 'region': 'eu-west-1', 'secret': '***'}" in show.output

    asked = runner.invoke(main, ["workflow", "resume", "1", "--store", store])
    assert asked.exit_code == 1
    assert ("run 1 used the credential parameter(s) secret, which the run store does not "
            "keep; pass them again: fusegen workflow resume 1 --param secret=...") in asked.output
    assert len(seen_passwords) == 1  # nothing ran

    monkeypatch.undo()
    seen_passwords.clear()
    real = wf_steps._transform_part

    def recording(step, *args):
        seen_passwords.append(step.storage_options["password"])
        return real(step, *args)

    monkeypatch.setattr(wf_steps, "_transform_part", recording)
    resumed = runner.invoke(main, ["workflow", "resume", "1", "--param", f"secret={SECRET}",
                                   "--store", store])
    assert resumed.exit_code == 0, resumed.output
    assert seen_passwords == [SECRET] * 3 and SECRET not in resumed.output
    assert read_output(tmp_path / "work" / RUN_DATE / "keep").column("id").to_pylist() \
        == [0, 2, 4]
    again = open_store(store).run(2)
    assert (again.status, again.resumes, again.params) == \
        ("succeeded", 1, {"n": 2, "region": "eu-west-1", "secret": MASK})
    assert SECRET.encode() not in db.read_bytes()


def test_resume_refuses_to_change_a_recorded_param(tmp_path, seen_passwords):
    wf = _file(tmp_path)
    store = f"sqlite:///{tmp_path}/runs.db"
    runner = CliRunner()
    runner.invoke(main, ["workflow", "run", wf, "--run-date", RUN_DATE, "--store", store])
    result = runner.invoke(main, ["workflow", "resume", "1", "--param", "n=3",
                                  "--store", store])
    assert result.exit_code == 1
    assert ("--param n: run 1 recorded n=2 and a resume runs with what it recorded; start "
            "a new run with `fusegen workflow run` to change it") in result.output


def test_scheduled_runs_store_credentials_masked_and_resume_with_the_real_ones(tmp_path):
    from datetime import datetime, timezone

    from fusegen.workflows.daemon import CronDaemon

    def at(hour):
        return datetime(2024, 5, 1, hour, tzinfo=timezone.utc)

    wf = parse_workflow({
        "name": "nightly", "params": {"secret": "default-secret", "n": 1},
        "schedule": {"cron": "0 * * * *"}, "workdir": "/tmp/never-used/{{ run_date }}",
        "steps": {"only": {"input": "in.parquet", "filter": "n > {{ n }}",
                           "storage_options": {"password": "{{ secret }}"}}}}, "n.yaml")
    store = open_store(tmp_path / "runs.db")
    now = [at(0)]
    seen = []
    first = CronDaemon([wf], store, params={"secret": SECRET}, clock=lambda: now[0],
                      execute=lambda t: seen.append(t.params))
    now[0] = at(1)
    [lost] = first.tick()  # started; its scheduler dies before running it
    assert store.run(lost.run_id).params == {"n": 1, "secret": MASK}
    assert SECRET.encode() not in (tmp_path / "runs.db").read_bytes()

    now[0] = at(3)  # the lost run's lock is two hours old
    second = CronDaemon([wf], store, params={"secret": SECRET}, clock=lambda: now[0],
                       execute=lambda t: seen.append(t.params), lease_seconds=600)
    [resumed] = second.tick()
    assert resumed.resumes == lost.run_id
    second.run_next()
    assert seen == [{"n": 1, "secret": SECRET}]
    assert store.run(resumed.run_id).params == {"n": 1, "secret": MASK}


def test_show_masks_credentials_a_run_recorded_in_plain_text(tmp_path):
    from datetime import datetime, timezone

    store = open_store(tmp_path / "runs.db")
    store.start_run("old", source="old.yaml", run_date=RUN_DATE, owner="h:1:x",
                    params={"api_token": "PW-token-1", "proxy": "http://u:PW-2@p", "n": 2},
                    now=datetime(2024, 5, 1, tzinfo=timezone.utc))
    show = CliRunner().invoke(main, ["workflow", "show", "1", "--store",
                                     f"sqlite:///{tmp_path}/runs.db"])
    assert show.exit_code == 0, show.output
    assert "PW-" not in show.output
    assert "params: {'api_token': '***', 'n': 2, 'proxy': '***'}" in show.output
