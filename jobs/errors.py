"""What a job can fail with, and the codes of per-row errors."""


class JobError(Exception):
    """A job cannot start or go on; the message says what to fix (credentials redacted)."""


# Per-row error codes: the row is written with finish_reason "error" and
# error "<code>: <message>"; the job goes on. The engine adds its own codes
# (e.g. prompt_too_long, invalid_params) the same way.
NULL_PROMPT = "null_prompt"
EMPTY_PROMPT = "empty_prompt"
INVALID_PROMPT = "invalid_prompt"  # not a string (or messages not role/content structs)
TEMPLATE_ERROR = "template_error"
INVALID_PARAMS = "invalid_params"


class ErrorRateExceeded(JobError):
    """Error rows passed `max_error_rate`: the job stopped, its committed parts kept (a
    rerun resumes it)."""


# `fusegen run`'s exit status (click's usage error is 2; a signal is 128 + its number).
EXIT_OK = 0  # every row generated
EXIT_FAILED = 1  # the job failed: a bad option or input, a failure mid-run, or
# max_error_rate passed (then resumable)
EXIT_ROW_ERRORS = 3  # the job finished, but some rows are errors (their `error` column)
