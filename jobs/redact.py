"""Keeping credentials out of logs, errors and the manifest.

Secrets hide in three places: storage options (by key name, at any depth), inside values
(a password in a URL's `user:password@`, `AccountKey=`, `sig=`, `token=` fragments) and
in text the job prints. The rule for storage options in the manifest: a value is shown
only when it is classified as safe -- a bool, a number or None under a key that is not
secret-bearing, or the text of a key on a known-safe list once URL userinfo and secret
fragments are masked. Everything else, including text under any key fusegen does not
know, is masked.

A `Redactor` knows the secret values of one job and blanks them in any text, plus
anything that looks like a credential in a URL or a fragment even when the job did not
declare it.
"""
from __future__ import annotations

import logging
import re
from contextlib import contextmanager

MASK = "***"
_SECRET_KEY = re.compile(r"secret|password|passwd|pwd|token|key|credential|signature|auth|"
                         r"session|cookie|connection_?string|conn_?str|(^|_)sas(_|$)|"
                         r"(^|_)sig(_|$)", re.I)
_NOT_SECRET_KEY = frozenset({"endpoint_url", "region_name", "key_prefix", "signature_version"})
# Keys whose text is kept (after masking userinfo and fragments): fsspec's and its
# backends' (s3fs, gcsfs, adlfs, HTTP) options that name places and behaviour, not people.
_SAFE_KEYS = frozenset({
    "endpoint_url", "endpoint", "region_name", "region", "key_prefix", "signature_version",
    "addressing_style", "profile", "profile_name", "project", "account_name", "bucket",
    "container", "location", "host", "port", "protocol", "scheme", "proxies", "http",
    "https", "use_ssl", "verify", "acl", "mode", "default_cache_type", "cache_type",
    "requester_pays", "version_aware", "consistency", "access", "retries", "max_attempts",
    "connect_timeout", "read_timeout", "timeout", "max_pool_connections", "block_size",
    "blocksize", "default_block_size", "default_fill_cache", "cache_regions",
    "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "anon",
    "storage_class", "server_side_encryption", "serversideencryption", "compression"})
_UNCLASSIFIED_MIN_LEN = 8  # shorter unknown text is masked in the manifest, not in messages
_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.\-]*://)([^/\s'\"]+)@", re.I)
_SECRET_QUERY = re.compile(
    r"([?&][^=&\s]*(?:sig|signature|token|key|secret|credential|password)[^=&\s]*=)[^&\s'\"]+",
    re.I)
# `name=value` where name is credential-like (`AccountKey=`, `X-Amz-Signature=`,
# `access_token=`): in connection strings, SAS tokens, query strings and free text.
_SECRET_FRAGMENT = re.compile(
    r"(?<![\w-])((?:[a-z0-9]+[_-])*(?:accountkey|sharedaccesskey|sharedaccesssignature|sig|"
    r"signature|token|password|passwd|pwd|secret|key|apikey|credentials?)\s*=\s*)"
    r"[^;&\s'\",]+", re.I)


def _norm(name) -> str:
    return str(name).lower().replace("-", "_")


def is_secret_key(name: str) -> bool:
    return bool(_SECRET_KEY.search(_norm(name))) and _norm(name) not in _NOT_SECRET_KEY


def _is_safe_key(name) -> bool:
    return name is not None and _norm(name) in _SAFE_KEYS


def public_options(options):
    """A copy of storage options with every value not classified as safe masked."""
    return _public(options, None)


def _public(value, key):
    if key is not None and is_secret_key(key):
        return MASK  # the whole value, whatever its shape
    if isinstance(value, dict):
        return {k: _public(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_public(v, key) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and _is_safe_key(key):
        return redact_url(value)
    return MASK


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif value is not None and not isinstance(value, bool):
        yield str(value)


def _embedded_secrets(text: str) -> set[str]:
    """The passwords of URLs and the values of secret fragments inside one string."""
    found = {part for m in _USERINFO.finditer(text) for part in m.group(2).split(":")}
    for pattern in (_SECRET_QUERY, _SECRET_FRAGMENT):
        found |= {m.group(0)[len(m.group(1)):] for m in pattern.finditer(text)}
    return found


def _secret_values(value, key=None) -> set[str]:
    """Every text in storage options that a message must not show."""
    if key is not None and is_secret_key(key):
        leaves = set(_leaves(value))
        return leaves.union(*map(_embedded_secrets, leaves))
    if isinstance(value, dict):
        return set().union(*(_secret_values(v, str(k)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return set().union(*(_secret_values(v, key) for v in value))
    if not isinstance(value, str):
        return set()
    found = _embedded_secrets(value)
    if not _is_safe_key(key) and len(value) >= _UNCLASSIFIED_MIN_LEN:
        found.add(value)
    return found


def redact_url(text: str) -> str:
    """The text with URL userinfo, signed-query values and secret fragments masked."""
    text = _USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)
    text = _SECRET_QUERY.sub(lambda m: m.group(1) + MASK, text)
    return _SECRET_FRAGMENT.sub(lambda m: m.group(1) + MASK, text)


class Redactor:
    """`secrets`: more values to blank (e.g. workflow parameters that feed credentials)."""

    def __init__(self, storage_options: dict | None = None, urls=(), secrets=()):
        found = _secret_values(storage_options or {})
        for url in urls:
            found |= _embedded_secrets(url or "")
        found |= {str(s) for s in secrets if s not in (None, "")}
        # Longest first, so a secret that contains another is masked whole. Very short
        # values are left alone: masking "a" everywhere would shred every message.
        self._secrets = sorted((s for s in found if len(s) >= 4 and s != MASK), key=len,
                               reverse=True)

    @staticmethod
    def is_secret_key(name: str) -> bool:
        """Whether a storage option (or a parameter) of this name holds a credential."""
        return is_secret_key(name)

    @staticmethod
    def public(path: list[str], value):
        """What the manifest shows for the storage option at `path` (its keys, outermost
        first): the value, the value with userinfo and fragments masked, or MASK."""
        if any(is_secret_key(key) for key in path):
            return MASK
        return _public(value, path[-1] if path else None)

    def __call__(self, text) -> str:
        text = str(text)
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return redact_url(text)


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
