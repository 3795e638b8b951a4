"""ShareGPT- and LooGLE-like request lengths: fitted distributions with published sources.

The paper's workloads (ShareGPT, LooGLE) are not in ``../shared/data``; these are
distributions fitted to their *published* statistics, drawn deterministically per seed:

* ``sharegpt``: the ShareGPT V3 set as SGLang's and vLLM's ``bench_serving`` sample it
  (``ShareGPT_V3_unfiltered_cleaned_split.json``; the first human turn is the prompt, the
  first reply's length the output; pairs with prompt or output < 4 tokens, prompt > 1,024 or
  prompt + output > 2,048 are dropped). Published means of that procedure: 676,842 input and
  613,123 generated tokens over 3,000 prompts (SGLang's benchmark run, gist
  merrymercy/e3041f0029db232adbe845cf995b3290, "benchmark_serving.py ... --dataset
  ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 3000"): **225.6 / 204.4 tokens**.
  Model: independent log-normals, ``sigma = 1`` (an assumption: no dispersion figure was
  found), the same filter by rejection, ``mu`` fitted so that the filtered means are the
  published ones (``mu`` 5.1168 / 4.8674; filtered medians 159 / 130).
* ``loogle``: LooGLE (Li et al., arXiv 2311.04939; github.com/bigai-nlco/LooGLE): 776
  documents, "over 24k tokens per document, many of which exceed 100k words". Prompt: a
  log-normal, ``sigma = 1`` (assumption), clipped at ``LOOGLE_MAX_PROMPT`` = 131,072 tokens
  (LooGLE's own predictors truncate a document to the model's ``--max_length``; 128k is an
  assumption), ``mu`` fitted to a 24,000-token mean (``mu`` 9.6284; median 15.2k; 1.6% clipped).
  Output: LooGLE's per-task generation limits (``config/task2maxlen.json``: short-dependency
  QA 300, long-dependency QA 500, summarization 500, cloze 50 tokens), one task drawn
  uniformly per request, the limit taken as the output (an assumption: a reasoning model
  fills its budget).

``fixed_output`` replaces every output length, as ``bench_serving --sharegpt-output-len``.

Legend: N requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import check_int, check_number
from .requests import Requests

__all__ = ["LENGTH_MODELS", "LengthModel", "poisson_lengths", "LOOGLE_MAX_PROMPT"]

LOOGLE_MAX_PROMPT = 131072


@dataclass(frozen=True)
class LengthModel:
    """A prompt/output length distribution (see the module doc for the sources).

    Attributes:
        name: ``sharegpt`` or ``loogle``.
        prompt_mu, prompt_sigma: log-normal of prompt tokens.
        output_mu, output_sigma: log-normal of output tokens (``output_choices`` empty).
        output_choices: output lengths drawn uniformly instead of the log-normal.
        min_tokens, max_prompt, max_total: rejection filter (prompt and output >= ``min_tokens``,
            prompt <= ``max_prompt``, prompt + output <= ``max_total``; 0 = no limit).
        clip_prompt: clip the prompt at this length instead (0 = none).
        source: one line for reports.
    """

    name: str
    prompt_mu: float
    prompt_sigma: float
    output_mu: float = 0.0
    output_sigma: float = 0.0
    output_choices: tuple[int, ...] = ()
    min_tokens: int = 1
    max_prompt: int = 0
    max_total: int = 0
    clip_prompt: int = 0
    source: str = ""

    def draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (prompt, output) int64 pairs, ``>= 1``, from ``rng`` (deterministic per seed)."""
        prompts, outputs, have = [], [], 0
        while have < n:
            m = 2 * (n - have) + 16
            p = np.maximum(1, np.rint(np.exp(self.prompt_mu + self.prompt_sigma * rng.standard_normal(m))))
            if self.output_choices:
                o = np.asarray(self.output_choices, dtype=np.float64)[rng.integers(0, len(self.output_choices), m)]
            else:
                o = np.maximum(1, np.rint(np.exp(self.output_mu + self.output_sigma * rng.standard_normal(m))))
            if self.clip_prompt:
                p = np.minimum(p, self.clip_prompt)
            keep = (p >= self.min_tokens) & (o >= self.min_tokens)
            if self.max_prompt:
                keep &= p <= self.max_prompt
            if self.max_total:
                keep &= p + o <= self.max_total
            prompts.append(p[keep])
            outputs.append(o[keep])
            have += int(keep.sum())
        return (np.concatenate(prompts)[:n].astype(np.int64), np.concatenate(outputs)[:n].astype(np.int64))


LENGTH_MODELS = {
    "sharegpt": LengthModel(
        "sharegpt", 5.1168, 1.0, 4.8674, 1.0, min_tokens=4, max_prompt=1024, max_total=2048,
        source="ShareGPT-like (log-normal fit to bench_serving's ShareGPT V3 means 225.6 / 204.4 tokens)"),
    "loogle": LengthModel(
        "loogle", 9.6284, 1.0, output_choices=(300, 500, 500, 50), clip_prompt=LOOGLE_MAX_PROMPT,
        source="LooGLE-like (log-normal documents, mean 24k tokens; outputs = LooGLE task limits)"),
}


def poisson_lengths(kind: str, rate: float, num: int, seed: int = 0, fixed_output: int | None = None) -> Requests:
    """``num`` Poisson arrivals at ``rate`` req/s with ``kind`` lengths (``LENGTH_MODELS``)."""
    if kind not in LENGTH_MODELS:
        raise ValueError(f"--lengths {kind!r}; allowed: trace, {', '.join(LENGTH_MODELS)}")
    rate = check_number("--rate", rate, 0, strict=True)
    num = check_int("--num-requests", num)
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=num)
    gaps[0] = 0.0
    model = LENGTH_MODELS[kind]
    prompt_N, output_N = model.draw(num, rng)
    label = model.source
    if fixed_output is not None:
        output_N = np.full(num, check_int("--output-len", fixed_output), dtype=np.int64)
        label += f", every output {fixed_output} tokens"
    return Requests(np.cumsum(gaps), prompt_N, output_N, f"poisson {rate:g} req/s, {label}")
