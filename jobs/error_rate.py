"""`max_error_rate`: the share of error rows past which a job stops.

Plain Python over part counts: the driver adds each part as it commits (the parts kept
from earlier runs first), and the job stops once the error rows of the committed parts
pass the limit. The rate is judged from the second committed part on, so the first part
is a whole sample of the rows (a bad row early in it does not stop the job), and never
once every part has committed: stopping then would save nothing, and the job finishes
with its error rows counted (`fusegen run` exits 3).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fusegen.jobs.errors import ErrorRateExceeded


@dataclass(slots=True)
class ErrorRate:
    limit: float  # a fraction in [0, 1]; 1 never stops
    num_planned: int  # the job's partitions
    num_parts: int = 0  # committed parts
    num_rows: int = 0  # rows of the committed parts
    num_errors: int = 0
    errors_by_code: dict = field(default_factory=dict)

    def add(self, stats) -> None:
        """A committed part's counts (a `PartStats`)."""
        self.num_parts += 1
        self.num_rows += stats.num_rows
        self.num_errors += stats.num_errors
        for code, n in stats.errors_by_code.items():
            self.errors_by_code[code] = self.errors_by_code.get(code, 0) + n

    @property
    def rate(self) -> float:
        return self.num_errors / self.num_rows if self.num_rows else 0.0

    def check(self) -> None:
        """Raise ErrorRateExceeded, saying which errors and what to do, once past the limit
        with a second part committed and parts still to run."""
        if self.rate <= self.limit or not 2 <= self.num_parts < self.num_planned:
            return
        codes = ", ".join(f"{code} {n}" for code, n in sorted(self.errors_by_code.items(),
                                                               key=lambda kv: -kv[1]))
        raise ErrorRateExceeded(
            f"{self.num_errors} of the {self.num_rows} rows committed are errors "
            f"({self.rate:.0%}: {codes}), past --max-error-rate {self.limit:g}; the job "
            "stopped, its committed parts kept. Fix what the `error` column names and "
            "resume, or pass --max-error-rate 1 to finish with error rows")
