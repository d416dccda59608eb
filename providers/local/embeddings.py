"""The built-in embedding provider: /v1/embeddings answered by the broker's own all-MiniLM-L6-v2.

It is an `EmbeddingBatcher` backend over the shared `SentenceModelHost`, so the endpoint and the
merge engine use one loaded model. Like OpenAI's `dimensions`, a shorter vector is the first
`dimensions` components renormalised to unit length (Matryoshka-style shortening; MiniLM was not
trained for it, so short vectors lose more quality than OpenAI's do).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mergebroker.errors import InvalidRequest, NotFound
from mergebroker.providers.base import EmbedResult
from mergebroker.providers.local.model import SentenceModelHost
from mergebroker.vectors import normalize_rows

DEFAULT_MODEL_NAMES = ("all-MiniLM-L6-v2", "local-minilm")


class LocalEmbeddingBackend:
    """Embeds with the local model under any of `model_names`; prompt tokens come from the model's tokenizer."""

    def __init__(self, host: SentenceModelHost, *, model_names: Sequence[str] = DEFAULT_MODEL_NAMES) -> None:
        self._host = host
        self.model_names = tuple(model_names)

    def serves(self, model: str) -> bool:
        """Whether `model` names this provider."""
        return model in self.model_names

    async def __call__(self, model: str, texts: list[str], dimensions: int | None) -> EmbedResult:
        """Unit vectors for `texts` (one model call), cut to `dimensions` if given, with the token count."""
        if not self.serves(model):
            raise NotFound(f"The model '{model}' does not exist", param="model", code="model_not_found")
        await self._host.load()
        width = self._host.dimension
        if dimensions is not None and not 1 <= dimensions <= width:
            raise InvalidRequest(f"dimensions must be between 1 and {width} for model '{model}'",
                                 param="dimensions")
        vectors = await self._host.encode(texts, normalize=True)
        if dimensions is not None:
            vectors = normalize_rows(vectors[:, :dimensions])
        tokens = await self._host.count_tokens(texts)
        return EmbedResult(vectors=list(np.ascontiguousarray(vectors)), prompt_tokens=sum(tokens))
