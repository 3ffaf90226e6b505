"""One elastic cycle on Ray's own autoscaler (benchmarks/serve/elastic_cycle.py: its fake multi-node provider, in a
PID namespace of its own): `serve run` of the shipped config from no worker node, 1 node, then 2 under load, and back
to 1 once the load is gone, with no request failed, the pirate adapter answering in pirate on both nodes, and the
adapter cache actor on the head, so the node that scale-up added holds nothing once its replica is gone."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks.serve.elastic_cycle import PROFILES
from benchmarks.serve.fake_cluster import isolated_command

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parent.parent
MILESTONES = ["first worker node", "serving", "load rises", "2 worker nodes", "2 replicas running", "load falls",
              "load stops", "1 replica running", "1 worker node"]


def _can_isolate() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def cycle(tmp_path_factory) -> dict:
    if not _can_isolate():
        pytest.skip("needs a PID namespace of its own (unshare --pid --fork --mount-proc), which this user cannot make")
    out = tmp_path_factory.mktemp("elastic") / "cycle.json"
    done = subprocess.run(isolated_command([sys.executable, "-m", "benchmarks.serve.elastic_cycle", "--out", str(out)]),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def test_nodes_are_added_under_load_and_removed_when_it_is_gone(cycle):
    events = cycle["events"]
    assert list(events) == MILESTONES, events
    nodes = [s["nodes"] for s in cycle["samples"]]
    assert nodes[0] == 0 and max(nodes) == 2 and nodes[-1] == 1
    assert nodes.index(2) < len(nodes) - nodes[::-1].index(2)  # 2 nodes held the peak, then 1 again
    # Serve's downscale delay, a replica's drain (the shipped config's 5-s draining period of its port) and the
    # autoscaler's idle timeout, with the metrics' look-back and a few of the autoscaler's 1-s rounds on top
    draining = float(yaml.safe_load((ROOT / "serve_config.yaml").read_text())["controller_options"]["runtime_env"][
        "env_vars"]["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"])
    quick = PROFILES["quick"]
    bound = quick.downscale_delay_s + draining + quick.idle_timeout_s + 15
    assert events["1 worker node"] - events["load stops"] <= bound, events


def test_no_request_failed_and_the_adapter_answered_from_the_cluster_cache_on_both_nodes(cycle):
    outcomes = cycle["outcomes"]
    assert outcomes and all(o["status"] == 200 and o["tokens"] > 0 for o in outcomes), \
        [o for o in outcomes if o["status"] != 200][:5]
    pirate = [o for o in outcomes if o["model"] == "pirate"]
    assert pirate and all(o["text"].startswith("Arr") for o in pirate), {o["text"] for o in pirate}
    assert not any(o["text"].startswith("Arr") for o in outcomes if o["model"] != "pirate")
    assert len(cycle["adapter_replicas"]["pirate"]) == 2  # both replicas, one a node, held it at the peak
    assert cycle["source_loads"]["pirate"] == 1  # read from its folder once, for both nodes


def test_the_adapter_cache_actor_runs_on_the_head(cycle):
    assert cycle["placement"] == {"lora-serve-adapter-cache": True}
