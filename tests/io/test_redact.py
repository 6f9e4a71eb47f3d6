"""Tests of wds_pad.io.redact: credentials hidden in every message, prose about them kept.

That no reader error carries a secret is tested with the reader (tests/io/test_ranges.py).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wds_pad.io import redact as wds_redact
from wds_pad.io.options import ReadOptions
from wds_pad.io.redact import redact


def test_redact_hides_credentials() -> None:
    ReadOptions(storage_options={"s3": {"key": "AKIAEXAMPLEKEY1", "secret": "s3cr3t/value+x"},
                                 "client_kwargs": {"aws_session_token": "TOKENVALUE123"}})
    text = ("s3://b/x.tar failed with key AKIAEXAMPLEKEY1 and s3cr3t/value+x token TOKENVALUE123 "
            "via https://alice:hunter22@host/x.tar?X-Amz-Signature=abcdef&X-Amz-Credential=AK%2F1"
            "&part=3 password=pw123 Authorization: Bearer eyJhbGciOi")
    out = redact(text)
    for secret in ("AKIAEXAMPLEKEY1", "s3cr3t/value+x", "TOKENVALUE123", "hunter22", "alice",
                   "abcdef", "AK%2F1", "pw123", "eyJhbGciOi"):
        assert secret not in out, (secret, out)
    assert "part=3" in out and "s3://b/x.tar" in out and "https://***@host/x.tar" in out
    assert redact("key sample_000001 at byte offset 42") == "key sample_000001 at byte offset 42"


_PROSE_WORDS = ["unable", "to", "locate", "credentials", "credential", "the", "token", "secret",
                "key", "password", "signature", "authorization", "expired", "refresh", "your",
                "see", "docs", "found", "missing", "in", "env", "set", "storage", "options",
                "check", "request", "we", "calculated", "does", "not", "match", "you",
                "provided", "Unable", "Partial", "The", "Check", "NoCredentialsError",
                "PartialCredentialsError", "SignatureDoesNotMatch", "ExpiredToken",
                "InvalidAccessKeyId", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "aws",
                "configure", "access", "denied", "none"]
_PROSE = st.lists(st.tuples(st.sampled_from(_PROSE_WORDS), st.sampled_from([" ", ": ", ", ", ". ", "; "])),
                  min_size=1, max_size=14).map(lambda ws: "".join(w + s for w, s in ws).rstrip())


@pytest.mark.parametrize("text", [
    "NoCredentialsError: Unable to locate credentials",
    "PartialCredentialsError: Partial credentials found in env, missing: AWS_SECRET_ACCESS_KEY",
    "Unable to locate credentials. You can configure credentials by running \"aws configure\".",
    "the token expired; refresh your credentials: see the docs",
    "SignatureDoesNotMatch: The request signature we calculated does not match the signature "
    "you provided. Check your key and signing method.",
    "ExpiredToken: The provided token has expired.",
    "InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our records.",
    "shard 's3://b/x.tar': the store found no credentials: set them in storage_options",
])
def test_redact_keeps_messages_about_credentials(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wds_redact, "_SECRETS", set())  # only the patterns, not other tests' secrets
    assert redact(text) == text


@settings(max_examples=300, deadline=None)
@given(text=_PROSE)
def test_redact_leaves_sentences_about_credentials_unchanged(text: str) -> None:
    with _no_registered_secrets():
        assert redact(text) == text


_SECRET_VALUE = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-_",
                        min_size=8, max_size=40).map(lambda v: v[:-1] + "7")  # keys carry a digit
_ASSIGNED = [
    "secret={v}", "aws_secret_access_key = {v}", "'secret': '{v}'", '"token": "{v}"', "token: {v}",
    "password={v}", "X-Amz-Security-Token: {v}", "Authorization: Bearer {v}",
    "Authorization: AWS4-HMAC-SHA256 Credential={v}/20240101/us-east-1/s3/aws4_request",
    "https://s3.example/b/k?X-Amz-Signature={v}&part=1", "Signature={v}", "https://user:{v}@host/x",
]


@settings(max_examples=200, deadline=None)
@given(before=_PROSE, after=_PROSE, value=_SECRET_VALUE, form=st.sampled_from(_ASSIGNED))
def test_redact_hides_secret_values_inside_prose(before: str, after: str, value: str, form: str) -> None:
    with _no_registered_secrets():
        out = redact(f"{before} {form.format(v=value)} {after}")
    assert value not in out and "***" in out
    assert out.startswith(f"{before} ") and out.endswith(f" {after}")  # the prose around is kept


class _no_registered_secrets:
    """redact() with only its patterns (hypothesis runs many examples in one test call)."""

    def __enter__(self) -> None:
        self.saved = wds_redact._SECRETS
        wds_redact._SECRETS = set()

    def __exit__(self, *exc: object) -> None:
        wds_redact._SECRETS = self.saved
