"""LoRAX's and TGI's answers: the /generate body (with details and best_of's other sequences) and the
/generate_stream events, rendered from the engine replica's events.

A stream writes the tokens of one engine event in one write: under load an event carries several tokens
(deployments/replica/pacing.py), each of them TGI's server-sent event of its own.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from deployments.api.errors import lorax_error, mid_stream_status
from deployments.api.events import PeerLost, TokenEntry, TokenEvent
from deployments.api.tgi_protocol import GenerateRequest
from deployments.api.token_texts import TokenTexts
from engine.errors import EngineDeadError

TGI_FINISH_REASONS = {"length": "length", "eos": "eos_token", "stop": "stop_sequence", "abort": "abort"}


class TgiTokens:
    """Generated tokens as TGI shows them."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts

    def show(self, token: TokenEntry) -> dict:
        """Special tokens (EOS above all) are marked, with their text, which the generated text leaves out; with
        return_k_alternatives, LoRAX's alternative_tokens."""
        shown = {"id": token.id, "text": token.text, "logprob": token.logprob, "special": False}
        if token.id in self.texts.special_ids:
            shown.update(text=self.texts.piece(token.id), special=True)
        if token.top_logprobs:  # LoRAX's return_k_alternatives
            texts = self.texts.texts(token.top_logprobs)
            shown["alternative_tokens"] = [{"id": i, "text": text, "logprob": logprob}
                                           for (i, logprob), text in zip(token.top_logprobs.items(), texts)]
        return shown


class TgiRenderer:
    """One request's answer in LoRAX's (TGI's) shapes."""

    def __init__(self, request: GenerateRequest, tokens: TgiTokens):
        self.request = request
        self.tokens = tokens

    def body(self, lasts: list[TokenEvent]) -> dict:
        """/generate's answer from each sequence's whole output: the one whose tokens' logprobs sum highest
        answers (as TGI picks best_of), the others in details.best_of_sequences."""
        best = max(lasts, key=lambda last: sum(token.logprob for token in last.entries()))
        body = {"generated_text": self._full_text(best.final.generated_text)}
        if self.request.parameters.details:
            body["details"] = self._details(best)
            if len(lasts) > 1:
                body["details"]["best_of_sequences"] = [self._sequence(last) for last in lasts if last is not best]
        return body

    async def sse(self, first: TokenEvent, events) -> AsyncIterator[str]:
        """TGI's stream: one server-sent event per token; the last carries the generated text and the details."""
        event = first
        while True:
            yield "".join(f"data:{json.dumps(payload)}\n\n" for payload in self._payloads(event))
            if event.finished:
                return
            try:
                event = await events.__anext__()
            except (PeerLost, EngineDeadError) as exc:  # as TGI: an error event ends the stream
                yield f"data:{json.dumps(lorax_error(str(exc), mid_stream_status(exc)))}\n\n"
                return

    def _payloads(self, event: TokenEvent) -> list[dict]:
        tokens = event.entries()
        payloads = [{"token": self.tokens.show(token), "generated_text": None, "details": None} for token in tokens]
        if event.final is not None and payloads:
            final = event.final
            payloads[-1]["generated_text"] = self._full_text(final.generated_text)
            payloads[-1]["details"] = {"finish_reason": TGI_FINISH_REASONS[final.finish_reason],
                                       "prompt_tokens": event.prompt_tokens,
                                       "generated_tokens": final.generated_tokens,
                                       "seed": self.request.parameters.seed,
                                       "adapter_version": final.adapter_version}
        return payloads

    def _full_text(self, generated: str) -> str:
        return self.request.inputs + generated if self.request.parameters.return_full_text else generated

    def _sequence(self, last: TokenEvent) -> dict:
        """One of best_of's other sequences, in TGI's BestOfSequence shape."""
        details = self._details(last)
        return {"generated_text": self._full_text(last.final.generated_text),
                **{key: details[key] for key in ("finish_reason", "generated_tokens", "seed", "prefill", "tokens")}}

    def _details(self, last: TokenEvent) -> dict:
        final, parameters = last.final, self.request.parameters
        prefill = []
        if parameters.decoder_input_details:
            prefill = [{"id": t.id, "text": t.text, "logprob": t.logprob} for t in last.prompt_entries]
        return {"finish_reason": TGI_FINISH_REASONS[final.finish_reason],
                "generated_tokens": final.generated_tokens, "prompt_tokens": last.prompt_tokens,
                "seed": parameters.seed, "adapter_version": final.adapter_version, "prefill": prefill,
                "tokens": [self.tokens.show(token) for token in last.entries()]}
