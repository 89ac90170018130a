"""The seeded requests of a benchmark: prompt token ids and output budgets."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from fusegen.jobs.bench.presets import LengthDist


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_ids: list[int]  # random ids in [0, vocab): no tokenizer work inside the timed run
    max_tokens: int  # the output budget; every engine generates exactly this many (ignore_eos)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def draw_length(dist: LengthDist, rng: random.Random) -> int:
    if dist.kind == "uniform":
        return rng.randint(dist.low, dist.high)
    # For log-normal X, E[X] = exp(mu + sigma^2 / 2): pick mu so that the mean is dist.mean.
    mu = math.log(dist.mean) - dist.sigma ** 2 / 2
    return min(dist.high, max(dist.low, round(rng.lognormvariate(mu, dist.sigma))))


def make_workload(num_requests: int, prompt_len: LengthDist, output_len: LengthDist,
                  vocab_size: int, seed: int = 0, shared_prefix_len: int = 0
                  ) -> list[BenchRequest]:
    """The same seed gives the same requests, whatever else the run does. Every prompt
    starts with the same `shared_prefix_len` tokens (drawn first), then its own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(shared_prefix_len)]
    requests = []
    for _ in range(num_requests):
        num_prompt = draw_length(prompt_len, rng)
        budget = draw_length(output_len, rng)
        prompt = prefix + [rng.randrange(vocab_size) for _ in range(num_prompt)]
        requests.append(BenchRequest(prompt, budget))
    return requests


def max_context(requests: list[BenchRequest]) -> int:
    return max((r.num_prompt_tokens + r.max_tokens for r in requests), default=0)


def describe_workload(requests: list[BenchRequest]) -> dict:
    prompts = [r.num_prompt_tokens for r in requests]
    outputs = [r.max_tokens for r in requests]
    return {
        "num_requests": len(requests),
        "num_prompt_tokens": sum(prompts),
        "num_output_tokens": sum(outputs),
        "prompt_len": _summary(prompts),
        "output_len": _summary(outputs),
    }


def _summary(values: list[int]) -> dict:
    if not values:
        return {"min": 0, "mean": 0.0, "max": 0}
    return {"min": min(values), "mean": round(sum(values) / len(values), 1), "max": max(values)}
