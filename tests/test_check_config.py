"""python -m deployments.check: a serve config's errors, one line each naming the field, before Ray starts; the
shipped configs pass."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import yaml

from deployments.check import check_file, main

ROOT = Path(__file__).parent.parent
SHIPPED = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
CLEAR_KEY = "sk-never-printed-123"


@dataclass
class Checked:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def check(tmp_path, capsys):
    """The check's main() on a config written to tmp_path: what it prints, and its exit code."""
    def run(config: dict) -> Checked:
        path = tmp_path / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config))
        code = main([str(path)])
        out = capsys.readouterr()
        return Checked(code, out.out, out.err)
    return run


def _changed(edit) -> dict:
    config = yaml.safe_load(yaml.safe_dump(SHIPPED))
    edit(config["applications"][0])
    return config


def test_the_shipped_serve_config_passes_on_the_command_line_without_starting_ray():
    done = subprocess.run([sys.executable, "-m", "deployments.check", "serve_config.yaml"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr, done.stdout.strip()) == (0, "", "serve_config.yaml: ok"), done.stderr


@pytest.mark.parametrize("name", ["configs/multi_node_gpu.yaml", "configs/tp_cpu.yaml"])
def test_the_other_shipped_serve_configs_pass(name):
    assert check_file(ROOT / name) == ([], [])


def test_a_key_in_clear_is_one_line_naming_the_field_and_never_the_key(check, tmp_path):
    done = check(_changed(lambda app: app["args"].update(api_keys=[{"name": "ops", "key": CLEAR_KEY}])))
    assert done.returncode == 1 and CLEAR_KEY not in done.stdout + done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"{tmp_path / 'serve_config.yaml'}: applications[0].args: api_keys.0: ")
    assert "key_sha256" in line


def test_each_error_gets_a_line_of_its_own(check):
    def edit(app):
        app["args"]["engine"]["max_num_seqz"] = 8
        app["args"]["routing"]["imbalance"] = -1
        app["deployments"][0]["max_ongoing_request"] = 4
    done = check(_changed(edit))
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "applications[0].deployments[0].max_ongoing_request: unknown key" in lines[0]
    del_typo = _changed(lambda app: (edit(app), app["deployments"][0].pop("max_ongoing_request")))
    lines = check(del_typo).stderr.splitlines()
    assert [line.split(": ", 2)[1:] for line in lines] == [
        ["applications[0].args", "routing.imbalance: Input should be greater than or equal to 0"]]


def test_an_unknown_engine_option_and_a_wrong_value_name_their_field(check):
    done = check(_changed(lambda app: app["args"]["engine"].update(max_num_seqz=8)))
    assert done.returncode == 1 and "applications[0].args: engine: unknown engine option(s): max_num_seqz" in done.stderr
    done = check(_changed(lambda app: app["args"]["engine"].update(max_num_seqs=0)))
    assert "applications[0].args: engine: max_num_seqs must be positive" in done.stderr


def test_deployment_names_and_the_autoscaling_policy_are_checked(check):
    def edit(app):
        app["deployments"][0]["name"] = "LLMServr"
        app["deployments"][0]["autoscaling_config"]["policy"]["policy_kwargs"]["kv_low"] = 0.95
    lines = check(_changed(edit)).stderr.splitlines()
    assert len(lines) == 2
    assert "applications[0].deployments[0].name: lora-serve has no such deployment" in lines[0]
    assert "applications[0].deployments[0].autoscaling_config.policy.policy_kwargs: need" in lines[1]
    moved = _changed(lambda app: app["deployments"][0]["autoscaling_config"]["policy"].update(
        policy_function="deployments.replica.autoscaling:NoSuchPolicy"))
    assert "has no attribute 'NoSuchPolicy'" in check(moved).stderr.splitlines()[0]
    dotted = _changed(lambda app: app["deployments"][0]["autoscaling_config"]["policy"].update(
        policy_function="deployments.replica.autoscaling.EngineLoadPolicy"))  # Ray takes this form too
    assert check(dotted).returncode == 0


def test_a_file_that_is_not_a_serve_config_is_said_so(tmp_path):
    (tmp_path / "broken.yaml").write_text("applications: [\n")
    assert check_file(tmp_path / "broken.yaml")[0][0].where == "file"
    problems, _ = check_file(ROOT / "configs" / "cpu_default.yaml")  # an engine preset, not a serve config
    assert [(p.where, p.reason) for p in problems] == [("applications", "Field required")]


def test_another_apps_args_are_left_unchecked_by_name_and_nothing_of_ray_starts(tmp_path):
    config = _changed(lambda app: None)
    config["applications"].append({"name": "other", "route_prefix": "/other", "import_path": "my.app:build",
                                   "args": {"anything": 1}})
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(config))
    assert check_file(path) == ([], ["applications[1]"])
    assert not ray.is_initialized()
