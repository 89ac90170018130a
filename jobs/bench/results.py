"""What one engine did on the benchmark's requests, and the rates derived from it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineResult:
    name: str  # "fusegen", "vllm", "hf_static", "hf_continuous", ...
    label: str  # how the table names it
    elapsed_s: float = 0.0  # wall time of the timed run (model load and warm-up excluded)
    load_s: float = 0.0  # model load, for information
    # (prompt tokens, useful output tokens) per request, in workload order. Useful output is
    # at most the request's budget: tokens a static batch generates past it are waste.
    counts: list[tuple[int, int]] = field(default_factory=list)
    budgets_met: bool = False  # every request produced exactly its budget
    model_flops: int = 0  # jobs.bench.flops over `counts`
    extra: dict = field(default_factory=dict)  # engine-specific figures (steps, padding, ...)
    # The engine's peak resident memory over its load and run (a child's ru_maxrss, or
    # fusegen's process high-water mark reset before its load); None: not measured.
    peak_rss_bytes: int | None = None
    skipped: str | None = None  # why it did not run

    @property
    def num_requests(self) -> int:
        return len(self.counts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(p for p, _ in self.counts)

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.counts)

    def rate(self, amount: float) -> float:
        return amount / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.rate(self.num_requests)

    @property
    def output_tokens_per_s(self) -> float:
        return self.rate(self.num_output_tokens)

    @property
    def total_tokens_per_s(self) -> float:
        return self.rate(self.num_prompt_tokens + self.num_output_tokens)

    @property
    def flops_per_s(self) -> float:
        return self.rate(self.model_flops)

    def to_dict(self) -> dict:
        if self.skipped is not None:
            return {"name": self.name, "label": self.label, "skipped": self.skipped}
        return {
            "name": self.name,
            "label": self.label,
            "elapsed_s": self.elapsed_s,
            "load_s": self.load_s,
            "num_requests": self.num_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "budgets_met": self.budgets_met,
            "requests_per_s": self.requests_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "model_flops": self.model_flops,
            "flops_per_s": self.flops_per_s,
            "peak_rss_bytes": self.peak_rss_bytes,
            **self.extra,
        }
