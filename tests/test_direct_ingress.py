"""Direct ingress on a local cluster: with Serve's direct-ingress settings in the controller's environment, the
app that build_app makes serves HTTP on its replica's own port too, with the same routes, streams and errors as
through Serve's proxy (deployments/routing/direct_ingress.py)."""

from __future__ import annotations

import pytest
import requests

from engine.free_ports import free_port
from tests.helpers import PROMPTS, complete, ray_and_serve, served_model, streamed_chunks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def urls(tiny_llama_path, tmp_path_factory):
    """(proxy URL, replica URL) of one replica of the tiny model."""
    from ray import serve

    from deployments.app import build_app

    direct_port, proxy_port = free_port(), free_port()
    env = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(direct_port),
           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(direct_port + 1),
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():  # Ray's processes inherit them: the controller reads them, build_app too
            patch.setenv(name, value)
        with ray_and_serve({"http_options": {"host": "127.0.0.1", "port": proxy_port}}, num_cpus=3,
                           include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray"))):
            engine = {"model": str(tiny_llama_path), "log_stats": False, "num_threads": 1, "max_loras": 0}
            serve.run(build_app({"engine": engine}), name="lora-serve", route_prefix="/")
            yield f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{direct_port}"


def test_the_replica_port_answers_as_the_proxy_does(urls):
    proxy, direct = urls
    model = served_model(proxy)
    assert served_model(direct) == model
    for prompt in PROMPTS[:3]:
        through_proxy = complete(proxy, model, prompt).json()["choices"][0]["text"]
        response = complete(direct, model, prompt)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == through_proxy


def test_the_replica_port_streams(urls):
    proxy, direct = urls
    # 48 tokens: a few engine steps' outputs can reach the event loop together, and a short answer may then
    # stream as one event with its text whole (it did, once, under CI's load with 6 tokens)
    model = served_model(proxy)
    expected = complete(proxy, model, PROMPTS[0], max_tokens=48).json()["choices"][0]["text"]
    response = complete(direct, model, PROMPTS[0], stream=True, max_tokens=48)
    chunks = streamed_chunks(response)
    assert len(chunks) >= 2 and "".join(c["choices"][0]["text"] for c in chunks) == expected


def test_the_replica_port_refuses_bad_requests_as_the_proxy_does(urls):
    for url in urls:
        response = requests.post(f"{url}/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": -1},
                                 timeout=30)
        assert response.status_code == 400
        assert "max_tokens" in response.json()["error"]["message"]
