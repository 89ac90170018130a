"""`max_error_rate`: the share of error rows past which a job stops.

Plain Python over the committed parts' own counts (`PartStats`, which the driver keeps):
the job stops once the error rows of the committed parts (those kept from earlier runs
included) pass the limit. The rate is judged from the second committed part on, so the
first part is a whole sample of the rows (a bad row early in it does not stop the job),
and never once every part has committed: stopping then would save nothing, and the job
finishes with its error rows counted (`fusegen run` exits 3).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from fusegen.jobs.errors import ErrorRateExceeded


@dataclass(slots=True, frozen=True)
class ErrorRate:
    limit: float  # a fraction in [0, 1]; 1 never stops
    num_planned: int  # the job's partitions
    kept: Collection = field(default=())  # PartStats committed by earlier runs

    def check(self, new: Collection) -> None:
        """Raise ErrorRateExceeded, saying which errors and what to do, once the kept and
        `new` (this run's committed PartStats) parts are past the limit with a second part
        committed and parts still to run."""
        if not 2 <= len(self.kept) + len(new) < self.num_planned:
            return
        parts = [*self.kept, *new]
        num_rows = sum(p.num_rows for p in parts)
        num_errors = sum(p.num_errors for p in parts)
        rate = num_errors / num_rows if num_rows else 0.0
        if rate <= self.limit:
            return
        codes = ", ".join(f"{code} {n}" for code, n in sorted(errors_by_code(parts).items(),
                                                               key=lambda kv: -kv[1]))
        raise ErrorRateExceeded(
            f"{num_errors} of the {num_rows} rows committed are errors "
            f"({rate:.0%}: {codes}), past --max-error-rate {self.limit:g}; the job "
            "stopped, its committed parts kept. Fix what the `error` column names and "
            "resume, or pass --max-error-rate 1 to finish with error rows")


def errors_by_code(parts: Iterable) -> dict[str, int]:
    """Error rows per error code over parts (PartStats), codes in first-seen order."""
    codes: dict[str, int] = {}
    for part in parts:
        for code, n in part.errors_by_code.items():
            codes[code] = codes.get(code, 0) + n
    return codes
