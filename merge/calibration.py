"""How a provider counts tokens against the broker: the ratio of its reported counts to the broker's own
(o200k_base), per provider, model and direction (prompt, completion), learnt from every call it answers.

The broker prices what a request would have cost sent alone in its own token counts, and providers count
with tokenizers of their own (Anthropic's, Gemini's and open models' count 30% more or fewer tokens than
o200k_base), so those counts are scaled by what each provider reported of the calls the broker sent.
Every call is a sample, merged ones included: the broker knows exactly what it sent, and a broker that
merges well may send few calls alone.

How it moves: the first sample sets the ratio; each later one moves it by `alpha` towards the sample.
Every sample is clamped to [`low`, `high`] first, so that one odd call (images, tools the broker did not
count) can neither set nor swing it far. Samples where either count is zero carry no information and are
ignored. Until a (provider, model, direction) has a sample, `ratio` falls back to what other providers
taught about the model (`learnt`), then to 1.0, and `samples` says so (the stats call that uncalibrated).

A call sent alone for one request is that request's own alone bill: its counts only teach the ratio, and
counting them costs the broker a tokenization of its prompt and its answer. `wants_sample` takes every such
call of a (provider, model) until `warm_samples` were offered, then one in `sample_every`: the ratio keeps
following the provider (at `alpha` 0.2 it rests on its last ten or so samples either way), and most lone
requests are sent without being counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Direction = Literal["prompt", "completion"]


@dataclass(frozen=True)
class CallTokens:
    """One call's tokens both ways: what the broker counted of what it sent and got back, and what the
    provider reported."""

    counted_prompt: int
    reported_prompt: int
    counted_completion: int
    reported_completion: int


class Calibration:
    """Per (provider, model, direction), the running ratio of the provider's token counts to the broker's."""

    def __init__(self, *, alpha: float = 0.2, low: float = 0.5, high: float = 2.0, warm_samples: int = 64,
                 sample_every: int = 8) -> None:
        if not 0 < alpha <= 1 or not 0 < low <= 1 <= high or warm_samples < 0 or sample_every < 1:
            raise ValueError("need 0 < alpha <= 1, 0 < low <= 1 <= high, warm_samples >= 0 and sample_every >= 1")
        self._alpha, self._low, self._high = alpha, low, high
        self._warm, self._every = warm_samples, sample_every
        self._ratios: dict[tuple[str, str, Direction], float] = {}
        self._samples: dict[tuple[str, str, Direction], int] = {}
        self._offered: dict[tuple[str, str], int] = {}  # lone calls offered as samples, by (provider, model)

    def wants_sample(self, provider: str, model: str) -> bool:
        """Whether to count this lone call of `provider` and `model` as a sample (see the module docstring)."""
        key = (provider, model)
        offered = self._offered.get(key, 0) + 1
        self._offered[key] = offered
        return offered <= self._warm or offered % self._every == 0

    def update(self, provider: str, model: str, reported: int, counted: int, direction: Direction = "prompt") -> float:
        """Fold in one sample: the provider reported `reported` tokens where the broker counted `counted`."""
        key = (provider, model, direction)
        if reported <= 0 or counted <= 0:
            return self.ratio(provider, model, direction)
        sample = reported / counted
        sample = self._low if sample < self._low else self._high if sample > self._high else sample
        current = self._ratios.get(key)
        updated = sample if current is None else current + self._alpha * (sample - current)
        self._ratios[key] = updated
        self._samples[key] = self._samples.get(key, 0) + 1
        return updated

    def observe_call(self, provider: str, model: str, tokens: CallTokens) -> None:
        """Fold in one answered call, both directions."""
        self.update(provider, model, tokens.reported_prompt, tokens.counted_prompt, "prompt")
        self.update(provider, model, tokens.reported_completion, tokens.counted_completion, "completion")

    def ratio(self, provider: str, model: str, direction: Direction = "prompt") -> float:
        """The current ratio: this provider's, else the model's over the providers that reported, else 1.0."""
        own = self._ratios.get((provider, model, direction))
        if own is not None:
            return own
        learnt = self.learnt(model, direction)
        return 1.0 if learnt is None else learnt

    def samples(self, provider: str, model: str, direction: Direction = "prompt") -> int:
        """How many samples the ratio of (provider, model, direction) rests on (the model's, where the
        provider has none)."""
        own = self._samples.get((provider, model, direction))
        if own is not None:
            return own
        return sum(n for (_, name, way), n in self._samples.items() if name == model and way == direction)

    def scale(self, provider: str, model: str, tokens: int, direction: Direction = "prompt") -> int:
        """`tokens` of the broker's count, in the provider's tokens."""
        return round(tokens * self.ratio(provider, model, direction))

    def learnt(self, model: str, direction: Direction = "prompt") -> float | None:
        """The mean ratio over the providers that reported on `model`, or None before any did (a count
        made for no provider in particular, such as `count_tokens`)."""
        ratios = [ratio for (_, name, way), ratio in self._ratios.items() if name == model and way == direction]
        return sum(ratios) / len(ratios) if ratios else None

    def as_dict(self) -> dict[str, dict[str, dict[str, float | int]]]:
        """The ratios learnt, JSON-ready: {provider/model: {direction: {"ratio", "samples"}}}."""
        out: dict[str, dict[str, dict[str, float | int]]] = {}
        for (provider, model, direction), ratio in sorted(self._ratios.items()):
            out.setdefault(f"{provider}/{model}", {})[direction] = {
                "ratio": round(ratio, 4), "samples": self._samples[(provider, model, direction)]}
        return out
