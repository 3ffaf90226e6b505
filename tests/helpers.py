"""Helpers the tests share: prompts, a free loopback port, tiny adapters, the HF greedy reference, and plain HTTP
clients of a served app (completions, streamed chunks, its model)."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import requests
import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

from deployments.replica.replica_stats import ReplicaStats
from engine import SamplingParams
from engine.free_ports import free_port
from engine.lora.provider import LoraShapes

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Quick brown fox",
    "Write a haiku about the sea.",
    "The meaning of life is",
    "Hello",
    "In 1969, the first humans landed on the",
    "A recipe for pancakes: first, take",
    "Translate to French: I like cheese.",
    "The three primary colours are",
    "Python is a programming language that",
    "Dear diary, today I",
    "The quick sort algorithm works by choosing a pivot element and then",
    "Q: What is 12 times 12?\nA:",
]



def write_tiny_adapters(base_path, root: Path, names, experts: bool = False) -> Path:
    """Random-weight rank-4 q,k,v,o PEFT adapters for the tiny model at base_path, one per name (seeds 0, 1, ...);
    experts: on a mixture of experts' experts too (target_parameters)."""
    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter

    config = AutoConfig.from_pretrained(base_path)
    for seed, name in enumerate(names):
        write_random_adapter(root / name, config, rank=4, seed=seed, experts=experts)
    return root


@lru_cache(maxsize=2)
def _hf_model(path: str):
    """The fp32 HF model at path, loaded once for the tests that take several references from it."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def forget_hf_models() -> None:
    """Drop the HF references loaded so far (a module's end: the next module loads what it needs again)."""
    _hf_model.cache_clear()


def hf_greedy(path, prompts, max_new_tokens, **generate_kwargs) -> list[list[int]]:
    """Reference: transformers generate, one prompt at a time, fp32 greedy."""
    return hf_generate(path, prompts, max_new_tokens, do_sample=False, **generate_kwargs)


def hf_generate(path, prompts, max_new_tokens, **generate_kwargs) -> list[list[int]]:
    """Reference: transformers generate with these arguments, one prompt at a time, fp32."""
    model = _hf_model(str(path))
    tok = AutoTokenizer.from_pretrained(path)
    results = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 pad_token_id=tok.eos_token_id, **generate_kwargs)
        results.append(out[0, ids.shape[1]:].tolist())
    return results


@contextmanager
def serving(cluster, app, name: str = "lora-serve"):
    """Serve `app` at the root of the shared cluster (tests/conftest.py serve_cluster), yielding the proxy's URL;
    then delete it and the cache actor and quota ledger its replicas made, so the next module starts from adapters
    and budgets of its own."""
    import ray
    from ray import serve

    from deployments.gate.ray_ledger import LEDGER_NAME
    from lora_cache.actor import ACTOR_NAME

    serve.run(app, name=name, route_prefix="/")
    try:
        yield cluster.url
    finally:
        serve.delete(name)
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["name"].startswith((ACTOR_NAME, LEDGER_NAME)):
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))


def actor_node(name: str) -> str:
    """The id of the node where the named actor runs, as the actor itself reads it."""
    import ray

    return ray.get(ray.get_actor(name).__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def replica_stats(replicas: int = 2) -> dict[str, ReplicaStats]:
    """Each live replica's stats (LLMServer.stats) in the app lora-serve, by replica, asked through a handle until
    `replicas` of them answered."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name="lora-serve")
    seen: dict[str, ReplicaStats] = {}
    for _ in range(40):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats.replica] = stats
        if len(seen) == replicas:
            break
    assert len(seen) == replicas, f"the handle reached {len(seen)} of {replicas} replicas"
    return seen


def adapter_requests(adapter: str) -> dict[str, int]:
    """The requests each replica served for an adapter."""
    return {r: s.adapter_requests(adapter) for r, s in replica_stats().items()}


def served_model(url: str) -> str:
    """The base model's name that the app at `url` lists first."""
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def complete(url: str, model: str, prompt: str, stream: bool = False, max_tokens: int = 6) -> requests.Response:
    """A greedy /v1/completions request of `max_tokens` tokens (ignore_eos), streamed or not."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    return requests.post(f"{url}/v1/completions", json=body, timeout=120, stream=stream)


def streamed_chunks(response: requests.Response) -> list[dict]:
    """The JSON chunks of an SSE completion stream, after checking that it ends with [DONE]."""
    lines = [line for line in response.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line[len(b"data: "):]) for line in lines[:-1]]


def lora_shapes_of(model_path) -> LoraShapes:
    """The LoRA shapes of the model in `model_path`, as its engine hands them to an adapter provider."""
    from transformers import AutoConfig

    from engine.models import lora_shapes

    return lora_shapes(AutoConfig.from_pretrained(model_path))


@contextmanager
def ray_and_serve(serve_options: dict | None = None, **init):
    """Ray started with `init` (and Serve, with `serve_options`, where given) for the with-block, and shut down
    after it whatever happens: a module whose start fails leaves no Ray session for the next module to meet."""
    import ray
    from ray import serve

    ray.init(**init)
    try:
        if serve_options is not None:
            serve.start(**serve_options)
        yield
    finally:
        if serve_options is not None:
            serve.shutdown()
        ray.shutdown()


@contextmanager
def uvicorn_serving(app):
    """`app` served by uvicorn on a free loopback port, in a thread of this process, yielding its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


GREEDY = SamplingParams(max_tokens=16, temperature=0.0)  # the adapter tests' references: PEFT-merged greedy


def peft_adapters(base_path, root, specs, seed):
    """Random-weight PEFT adapters saved under root/<name>, each spec (rank, target modules) or (rank, target
    modules, target parameters); returns PEFT-merged greedy outputs per adapter."""
    from peft import LoraConfig, get_peft_model

    tok = AutoTokenizer.from_pretrained(base_path)
    references = {}
    for i, (name, (rank, targets, *parameters)) in enumerate(specs.items()):
        torch.manual_seed(seed + i)
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                            fan_in_fan_out=base.config.model_type == "gpt2",
                            target_parameters=parameters[0] if parameters else None)
        peft_model = get_peft_model(base, config)
        peft_model.save_pretrained(root / name)
        merged = peft_model.merge_and_unload().eval()
        references[name] = [_peft_greedy(merged, tok, p) for p in PROMPTS[:4]]
    return references


def _peft_greedy(model, tok, prompt):
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                             do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()
