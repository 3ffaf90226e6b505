"""The base of every pydantic model at the HTTP edge and in the app's arguments: a field that the model does not
declare is refused by name (pydantic's `extra_forbidden` error names it), never silently dropped, so a client
learns that an option it sent is not implemented.

OpenAI's models also take null for any optional field as not given, as OpenAI's API and vLLM do: clients send
`"temperature": null`, and the OpenAI SDK's own assistant messages carry `"refusal": null` and `"audio": null`, which
a multi-turn client sends back. A null asks for nothing, so it is dropped before validation (the field keeps its
default); an undeclared field with a value is still refused by name."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenAIModel(StrictModel):
    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data
