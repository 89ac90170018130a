"""Keeping credentials out of logs, errors and the manifest.

Secrets come from two places: storage options (any key that looks like a credential)
and URLs (user:password@ and signature-like query parameters). A `Redactor` knows the
secret values of one job and blanks them in any text, plus anything that looks like a
credential in a URL even when the job did not declare it.
"""
from __future__ import annotations

import logging
import re
from contextlib import contextmanager

MASK = "***"
_SECRET_KEY = re.compile(r"secret|password|passwd|token|key|credential|signature|auth|session",
                         re.I)
_NOT_SECRET_KEY = re.compile(r"^(endpoint_url|region_name|key_prefix)$", re.I)
_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.\-]*://)([^/@\s]+)@", re.I)
_SECRET_QUERY = re.compile(
    r"([?&][^=&\s]*(?:sig|signature|token|key|secret|credential|password)[^=&\s]*=)[^&\s'\"]+",
    re.I)


def is_secret_key(name: str) -> bool:
    return bool(_SECRET_KEY.search(name)) and not _NOT_SECRET_KEY.match(name)


def public_options(options):
    """A copy of storage options with every credential-like value masked."""
    if isinstance(options, dict):
        return {k: MASK if is_secret_key(str(k)) and not isinstance(v, dict)
                else public_options(v) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return [public_options(v) for v in options]
    return options


def _secret_values(options) -> set[str]:
    found = set()
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(v, (dict, list, tuple)):
                found |= _secret_values(v)
            elif is_secret_key(str(k)) and v not in (None, ""):
                found.add(str(v))
    elif isinstance(options, (list, tuple)):
        for v in options:
            found |= _secret_values(v)
    return found


def redact_url(text: str) -> str:
    text = _USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)
    return _SECRET_QUERY.sub(lambda m: m.group(1) + MASK, text)


class Redactor:
    def __init__(self, storage_options: dict | None = None, urls=()):
        secrets = _secret_values(storage_options or {})
        for url in urls:
            for m in _USERINFO.finditer(url or ""):
                secrets |= {part for part in m.group(2).split(":") if part}
        # Longest first, so a secret that contains another is masked whole. Very short
        # values are left alone: masking "a" everywhere would shred every message.
        self._secrets = sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True)

    def __call__(self, text) -> str:
        text = redact_url(str(text))
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text


class _RedactingFilter(logging.Filter):
    def __init__(self, redactor: Redactor):
        super().__init__()
        self.redactor = redactor

    def filter(self, record):
        record.msg, record.args = self.redactor(record.getMessage()), ()
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = self.redactor(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


@contextmanager
def redacted_logging(redactor: Redactor, logger_names=("", "distributed", "fusegen")):
    """Redact every record that reaches a handler of these loggers (the root's included)."""
    flt = _RedactingFilter(redactor)
    handlers = {h for name in logger_names for h in logging.getLogger(name).handlers}
    for h in handlers:
        h.addFilter(flt)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(flt)
