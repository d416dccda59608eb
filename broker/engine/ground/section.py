"""The base of every settings section: a pydantic model that refuses unknown keys, so a typo in the config is an
error naming the key rather than a setting silently left at its default."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A settings section (`extra="forbid"`)."""

    model_config = ConfigDict(extra="forbid")
