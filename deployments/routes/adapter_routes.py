"""The adapter lifecycle and model routes (vLLM's): /v1/models and retrieve, /v1/load_lora_adapter and
/v1/unload_lora_adapter; and tokenizing (/tokenize, /detokenize) for the base model and the adapters a tenant
sees."""


import dataclasses
import time

from fastapi import APIRouter, Request

from deployments.api import openai_protocol as oai
from deployments.api.errors import RequestRefused, client_message
from deployments.api.tokenizing import (
    ChatTokenize,
    Detokenize,
    PromptTokenize,
    TgiTokenize,
    detokenize,
    tokenize_prompt,
    tokenize_tgi,
)
from deployments.gate.gate import Tenant
from deployments.routes.edge import (
    chat_prompt_of,
    check_scope,
    listed_adapters,
    residence,
    served_of,
    tenant_of,
)
from deployments.routes.engine_client import Served
from engine.errors import AdapterNotFoundError
from lora_cache.adapter_folder import AdapterCacheUnavailableError
from lora_cache.cache_stats import AdapterResidence

router = APIRouter()


@router.get("/v1/models")
async def models(http: Request) -> dict:
    """The base model and the adapters the cache actor knows: each with the content id of its weights (once
    loaded), its lora_path when it was loaded at run time, and where it resides."""
    served = served_of(http)
    context = served.client.max_model_len()
    base = _model_card(served.model_name, served.model_name, None, context)
    adapters = [_adapter_card(a, served.model_name, where, context)
                for a, where in (await listed_adapters(served, tenant_of(http))).items()]
    return {"object": "list", "data": [base] + adapters}


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: oai.LoadLoRAAdapterRequest, http: Request) -> dict:
    """vLLM's route: serve `lora_name` from `lora_path`; loading a name again replaces its weights (requests
    already running finish on the old ones). Answers once every live replica serves the new weights."""
    served = served_of(http)
    tenant_of(http).check_manage(request.lora_name)
    if request.lora_name == served.model_name:  # requests naming it would be the base model's
        raise RequestRefused(f"lora_name {request.lora_name!r} is the base model's name; choose another")
    done = await _lifecycle(served.client.register_adapter(request.lora_name, request.lora_path))
    return {"lora_name": done.name, "content_id": done.content_id,
            "message": f"LoRA adapter {done.name!r} loaded from {request.lora_path}"}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: oai.UnloadLoRAAdapterRequest, http: Request) -> dict:
    """vLLM's route: stop serving what load_lora_adapter loaded under `lora_name`."""
    served = served_of(http)
    tenant_of(http).check_manage(request.lora_name)
    await _lifecycle(served.client.unregister_adapter(request.lora_name))
    return {"lora_name": request.lora_name, "message": f"LoRA adapter {request.lora_name!r} unloaded"}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, http: Request) -> dict:
    """OpenAI's retrieve: the base model or a known adapter, as /v1/models lists it."""
    cards = (await models(http))["data"]
    for card in cards:
        if card["id"] == model:
            return card
    raise RequestRefused(f"model {model!r} is not served here (GET /v1/models lists what is)", 404)


@router.post("/tokenize")
async def tokenize_text(request: PromptTokenize | ChatTokenize | TgiTokenize, http: Request):
    """vLLM's forms (a prompt, or messages through the chat template) and TGI's (`inputs`):
    deployments/api/tokenizing.py."""
    served = served_of(http)
    model = None if isinstance(request, TgiTokenize) else request.model  # TGI's form names none: the base's
    await _check_tokenizer_model(served, model, tenant_of(http))
    if isinstance(request, TgiTokenize):
        return tokenize_tgi(served.tokenizer, request.inputs, request.add_special_tokens)
    text = (request.prompt if isinstance(request, PromptTokenize)
            else chat_prompt_of(served, request.messages, None, request.template_options()))
    return tokenize_prompt(served.tokenizer, text, request.add_special_tokens, request.return_token_strs,
                           served.client.max_model_len())


@router.post("/detokenize")
async def detokenize_ids(request: Detokenize, http: Request) -> dict:
    """vLLM's: the text of a list of token ids."""
    served = served_of(http)
    await _check_tokenizer_model(served, request.model, tenant_of(http))
    try:
        return detokenize(served.tokenizer, request.tokens)
    except ValueError as exc:
        raise RequestRefused(str(exc), 400) from None


async def _check_tokenizer_model(served: Served, model: str | None, tenant: Tenant) -> None:
    """A tokenizing request's model: none, the base model or an adapter the tenant sees (they all share the
    base model's tokenizer); another is refused, as a generation request naming it would be."""
    adapter = None if model == served.model_name else model
    check_scope(tenant, adapter)
    if adapter is not None and adapter not in await residence(served, tenant):
        raise RequestRefused(f"model {adapter!r} is not served here: tokenizing takes the base model's name "
                             f"({served.model_name!r}) or a loaded adapter's (GET /v1/models lists them)", 404)


async def _lifecycle(change):
    """Await a load or unload in the cache actor; its AdapterError becomes a 404 or a 400 with the reason, a cache
    that does not answer a 503."""
    try:
        return await change
    except AdapterCacheUnavailableError as exc:
        raise RequestRefused(str(exc), 503, exc.retry_after_s) from None
    except AdapterNotFoundError as exc:
        raise RequestRefused(client_message(exc), 404) from None
    except ValueError as exc:  # AdapterError and a server without LoRA
        raise RequestRefused(client_message(exc), 400) from None


def _model_card(name: str, root: str, parent: str | None, max_model_len: int) -> dict:
    """A /v1/models entry's fields as vLLM gives them: OpenAI's (created as vLLM sets it, at the answer), the
    weights' root, the base model an adapter applies to, and the context a request may fill."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "lora-serve", "root": root,
            "parent": parent, "max_model_len": max_model_len}


def _adapter_card(name: str, base_model: str, where: AdapterResidence, max_model_len: int) -> dict:
    """An adapter's entry in /v1/models: the model card, its content id and lora_path, and its residence."""
    residence = dataclasses.asdict(where)
    lora_path = residence.pop("lora_path")
    return {**_model_card(name, lora_path or name, base_model, max_model_len),
            "content_id": residence.pop("content_id"), "lora_path": lora_path, "residence": residence}
