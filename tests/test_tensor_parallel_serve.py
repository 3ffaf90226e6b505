"""`serve run configs/tp_cpu.yaml`, as a user runs it: the embedded SmolLM2 over 3 tensor-parallel workers (the
replica and two Ray actors in its placement group), gloo between them, in a Ray cluster of its own.

The config is the shipped one in float32 (for token equality with the unsharded engine), on a free port, with the
shipped adapter and a random one of another rank. The OpenAI and LoRAX routes, streamed, through their own
clients, with adapters and the base model in one batch, give the unsharded offline engine's tokens. Then one
worker is killed under load: every request in flight ends within seconds, with a 503 or a stream's error event
naming the dead worker, and Serve's replacement replica, with workers of its own, serves again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from engine import LLM, SamplingParams
from engine.free_ports import free_port
from lora_cache.local_cache import local_adapters

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parent.parent
START_S = 300  # Ray, Serve, the replica and its two workers, each loading SmolLM2, on 2 busy cores
WORKERS = 3
PROMPTS = ["Tell me about the sea.", "The three primary colours are", "Write a haiku about autumn."]
ADAPTERS = ("pirate", "wide", None)  # the shipped rank-8 adapter, a random rank-16 one, the base model
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters_root(smollm2_path, tmp_path_factory) -> Path:
    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter

    root = tmp_path_factory.mktemp("tp-adapters")
    shutil.copytree(ROOT / "examples" / "adapters" / "pirate", root / "pirate")
    write_random_adapter(root / "wide", AutoConfig.from_pretrained(smollm2_path), rank=16, seed=3)
    return root


@pytest.fixture(scope="module")
def served(adapters_root, tmp_path_factory):
    """serve run of the shipped tp_cpu.yaml, float32, on a free port, with these adapters: yields its URL."""
    config = yaml.safe_load((ROOT / "configs" / "tp_cpu.yaml").read_text())
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    [app] = config["applications"]
    assert app["args"]["engine"]["tensor_parallel_size"] == WORKERS
    app["args"]["engine"].update(dtype="float32", adapters_root=str(adapters_root), log_stats=False)
    path = tmp_path_factory.mktemp("tp-serve") / "tp_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    ray_temp = Path(tempfile.mkdtemp(prefix="lst-", dir="/tmp"))  # short: Ray's socket paths fit 107 bytes
    output = ray_temp / "serve-run.out"
    with output.open("wb") as out:
        process = subprocess.Popen([shutil.which("serve") or "serve", "run", str(path)], cwd=ROOT,
                                   env={**os.environ, "RAY_TMPDIR": str(ray_temp)}, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_serving(url, process, output, START_S)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(ray_temp, ignore_errors=True)


def _wait_serving(url: str, process: subprocess.Popen, output: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"serve run exited: {output.read_text()[-3000:]}"
        if _generates(url):
            return
        time.sleep(1)
    raise TimeoutError(f"no answer in {timeout_s} s: {output.read_text()[-3000:]}")


def _generates(url: str) -> bool:
    try:
        r = requests.post(f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=20)
    except requests.RequestException:
        return False
    return r.status_code == 200


@pytest.fixture(scope="module")
def expected(smollm2_path, adapters_root, tokenizer) -> dict[tuple[str, str | None], str]:
    """The unsharded offline engine's greedy text for each (route, adapter): a completion of PROMPTS[i] and a
    chat answer to it."""
    llm = LLM(str(smollm2_path), dtype="float32", adapters=local_adapters, max_loras=2,
              adapters_root=str(adapters_root), log_stats=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    texts = {}
    for prompt, adapter in zip(PROMPTS, ADAPTERS):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        done = llm.generate([prompt, chat], params, use_tqdm=False, adapters=[adapter, adapter])
        texts[("completion", adapter)], texts[("chat", adapter)] = done[0].text, done[1].text
    llm.close()
    return texts


def _openai_streams(url: str, prompt: str, adapter: str | None) -> tuple[str, str]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = adapter or "smollm2-135m-instruct"
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
    text = "".join(chunk.choices[0].text for chunk in completion)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=MAX_TOKENS, temperature=0, stream=True)
    return text, "".join(c.choices[0].delta.content or "" for c in chat if c.choices)


def test_openai_and_lorax_routes_streamed_with_adapters_equal_the_unsharded_engine(served, expected):
    from lorax import Client

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # the three, adapters and base, in the same batches
        answers = list(pool.map(_openai_streams, [served] * len(PROMPTS), PROMPTS, ADAPTERS))
    for (completion, chat), adapter in zip(answers, ADAPTERS):
        assert completion == expected[("completion", adapter)], adapter
        assert chat == expected[("chat", adapter)], adapter
    client = Client(served)
    for prompt, adapter in zip(PROMPTS, ADAPTERS):
        kwargs = {"adapter_id": adapter} if adapter else {}
        streamed = list(client.generate_stream(prompt, max_new_tokens=MAX_TOKENS, **kwargs))
        assert streamed[-1].generated_text == expected[("completion", adapter)], adapter
        text = "".join(event.token.text for event in streamed if not event.token.special)  # EOS is shown, marked
        assert text == streamed[-1].generated_text


def _workers() -> list[psutil.Process]:
    """This module's cluster's tensor-parallel worker actors (the only Ray cluster these tests run now)."""
    return [p for p in psutil.process_iter(["cmdline"])
            if any("TensorParallelWorker" in part for part in p.info["cmdline"] or [])]


def _long_request(url: str, stream: bool, begun: threading.Semaphore) -> tuple[int, str]:
    """Its status and body; `begun` is released once a stream's first event has come."""
    body = {"model": "pirate", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": stream}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120, stream=stream)
    if not stream:
        return r.status_code, r.text
    chunks = r.iter_content(chunk_size=None, decode_unicode=True)
    first = next(chunks, "")
    begun.release()
    return r.status_code, first + "".join(chunks)


def test_a_dead_worker_ends_requests_with_503_and_serve_replaces_the_replica(served):
    before = _workers()
    assert len(before) == WORKERS - 1
    streams = (False, True, False, True)
    begun = threading.Semaphore(0)
    with ThreadPoolExecutor(len(streams)) as pool:
        requests_ = [pool.submit(_long_request, served, stream, begun) for stream in streams]
        for _ in range(sum(streams)):  # every request is then in the engine, decoding
            assert begun.acquire(timeout=60), "a stream did not begin"
        killed = time.monotonic()
        before[0].send_signal(signal.SIGKILL)
        answers = [future.result(timeout=60) for future in requests_]
    assert time.monotonic() - killed < 30, "the requests in flight hung"
    for status, text in answers:
        assert "worker rank" in text and "died" in text, text[-500:]
    for (status, text), stream in zip(answers, streams):
        if stream:  # the stream had begun: an error event, then its end
            assert status == 200 and '"error"' in text and text.rstrip().endswith("[DONE]"), text[-500:]
        else:
            assert status == 503, text
    deadline = time.monotonic() + 180
    while not _generates(served):
        assert time.monotonic() < deadline, "no healthy replica 180 s after the worker died"
        time.sleep(2)
    after = _workers()
    assert len(after) == WORKERS - 1 and not {p.pid for p in after} & {p.pid for p in before}
