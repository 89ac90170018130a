"""Credential redaction in text, URLs, storage options and log records."""
import logging

from fusegen.jobs.redact import MASK, Redactor, public_options, redact_url


def test_redact_url_userinfo_and_signed_query():
    assert redact_url("s3://KEY:SECRET@bucket/x") == f"s3://{MASK}@bucket/x"
    url = "https://h/p?X-Amz-Signature=abc123&X-Amz-Credential=AK%2F&part=2"
    assert redact_url(url) == f"https://h/p?X-Amz-Signature={MASK}&X-Amz-Credential={MASK}&part=2"
    assert redact_url("memory://bucket/data") == "memory://bucket/data"


def test_public_options_masks_nested_secrets_only():
    opts = {"key": "AK", "secret": "S", "token": None, "anon": False,
            "client_kwargs": {"endpoint_url": "http://x", "aws_secret_access_key": "S2"}}
    assert public_options(opts) == {
        "key": MASK, "secret": MASK, "token": MASK, "anon": False,
        "client_kwargs": {"endpoint_url": "http://x", "aws_secret_access_key": MASK}}


def test_redactor_masks_declared_secret_values_anywhere():
    r = Redactor({"secret": "verysecret", "client_kwargs": {"aws_session_token": "tok-123"}},
                 urls=["s3://userid:pw12345@b/k"])
    text = r("failed with verysecret and tok-123 for userid / pw12345")
    assert text == f"failed with {MASK} and {MASK} for {MASK} / {MASK}"


def test_redacting_log_filter(caplog):
    from fusegen.jobs.redact import redacted_logging

    r = Redactor({"password": "hunter22"})
    with caplog.at_level(logging.INFO), redacted_logging(r):
        logging.getLogger("fusegen.test").info("connecting with %s", "hunter22")
        try:
            raise ValueError("bad hunter22")
        except ValueError:
            logging.getLogger("fusegen.test").exception("boom")
    assert "hunter22" not in caplog.text
    assert "connecting with ***" in caplog.text
