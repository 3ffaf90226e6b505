"""The base of every pydantic model at the HTTP edge and in the app's arguments: a field that the model does not
declare is refused by name (pydantic's `extra_forbidden` error names it), never silently dropped, so a client
learns that an option it sent is not implemented."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
