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


# -- secrets inside values (issue 11, item 8) ------------------------------------------------

LEAKY_OPTIONS = {
    "client_kwargs": {"endpoint_url": "http://admin:PW-endpoint@minio:9000",
                      "region_name": "eu-west-1"},
    "config_kwargs": {"proxies": {"https": "http://u:PW-proxy@proxy:3128"},
                      "signature_version": "s3v4", "connect_timeout": 5},
    "connection_string": "DefaultEndpointsProtocol=https;AccountName=acct;"
                         "AccountKey=PW-accountkey==;EndpointSuffix=core.windows.net",
    "sas": "sv=2022-11-02&ss=b&sig=PW-sas%3D",
    "account_name": "acct",
    "headers": {"Cookie": "session=PW-cookie", "X-Trace": 7},
    "custom_plugin_option": "PW-unclassified-value",
    "anon": False,
    "retries": [{"token": "PW-listed"}, 3],
}
SECRETS = ("PW-endpoint", "PW-proxy", "PW-accountkey", "PW-sas", "PW-cookie",
           "PW-unclassified", "PW-listed")


def test_public_options_masks_secrets_inside_values():
    assert public_options(LEAKY_OPTIONS) == {
        "client_kwargs": {"endpoint_url": f"http://{MASK}@minio:9000",
                          "region_name": "eu-west-1"},
        "config_kwargs": {"proxies": {"https": f"http://{MASK}@proxy:3128"},
                          "signature_version": "s3v4", "connect_timeout": 5},
        "connection_string": MASK,  # a secret-bearing key: the whole value
        "sas": MASK,
        "account_name": "acct",  # a known-safe key keeps its value
        "headers": {"Cookie": MASK, "X-Trace": 7},  # an unknown key's text: masked
        "custom_plugin_option": MASK,
        "anon": False,  # plain bools and numbers are kept
        "retries": [{"token": MASK}, 3],
    }


def test_the_manifest_config_holds_no_secret():
    import json

    from fusegen.jobs import JobSpec

    spec = JobSpec(model="m", input="s3://in/x.parquet", output="s3://out/run",
                   storage_options=LEAKY_OPTIONS)
    text = json.dumps(spec.public_dict(), default=str)
    assert [s for s in SECRETS if s in text] == []
    assert "http://***@minio:9000" in text and "eu-west-1" in text


def test_fragments_in_free_text_are_masked():
    text = ("open failed: DefaultEndpointsProtocol=https;AccountName=a;AccountKey=abc/def==;"
            " url https://a.blob.core.windows.net/c?sv=1&sig=xyz%2F&se=2 "
            "SharedAccessSignature=sv=1&sig=qq token=tok123 password=hunter2")
    assert redact_url(text) == (
        f"open failed: DefaultEndpointsProtocol=https;AccountName=a;AccountKey={MASK};"
        f" url https://a.blob.core.windows.net/c?sv=1&sig={MASK}&se=2 "
        f"SharedAccessSignature={MASK}&sig={MASK} token={MASK} password={MASK}")
    assert redact_url("design=3 config=4 signal=ok") == "design=3 config=4 signal=ok"


def test_userinfo_with_an_at_sign_in_the_password():
    assert redact_url("http://u:p@ss@host/x and ftp://a:b@c") == \
        f"http://{MASK}@host/x and ftp://{MASK}@c"


def test_redactor_masks_secrets_found_inside_values():
    r = Redactor(LEAKY_OPTIONS)
    # each secret as an error message would quote it: a URL's password, a whole value
    leaked = ("PW-endpoint PW-proxy PW-accountkey== sv=2022-11-02&ss=b&sig=PW-sas%3D "
              "session=PW-cookie PW-unclassified-value PW-listed")
    text = r(f"boom: {leaked}")
    assert [s for s in SECRETS if s in text] == []
    r = Redactor({}, secrets=["my-param-secret"])
    assert r("failed with my-param-secret") == f"failed with {MASK}"
