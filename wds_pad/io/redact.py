"""Credentials: remembered when options carry them, and hidden in every message.

Invariants:
    * :func:`redact` replaces with ``***`` every credential it can tell: values of
      secret-like storage options registered in this process (:func:`register_secrets`,
      called by ``ReadOptions`` and ``get_filesystem``), ``user:password@`` in URLs,
      signed query parameters and the values of ``secret=...``-like assignments.
    * Prose about credentials is kept word for word: in ``name: value`` sentences only a
      value that looks like a key is hidden.
    * The registry of secrets is per process, guarded by a lock, and only ever grows.
    * Imports nothing of wds_pad: every other io module may use it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["redact"]

_SECRET_NAME = re.compile(r"key|secret|token|passw|credential|auth|signature|sig$|sas", re.I)
_SECRETS: set[str] = set()
# words of an Authorization value that are not secret ("Bearer <token>"): never hidden
# on their own, or "Authorization: Bearer x" would turn into "Authorization: *** x"
_AUTH_SCHEMES = frozenset({"bearer", "basic", "digest", "token", "negotiate", "aws4-hmac-sha256"})
_SECRETS_LOCK = threading.Lock()
_USERINFO = re.compile(r"(\b[a-zA-Z][\w+.-]*://)[^/\s@?#]+@")
_SIGNED_PARAM = re.compile(
    r"([?&;][^=&\s#]*(?:sig|signature|credential|token|secret|key|password|auth)[^=&\s#]*=)"
    r"[^&\s#'\"]*", re.I)
# ``name=value``, ``"name": "value"``, ``name: value``, where name is a whole identifier
# holding a secret word (aws_secret_access_key, X-Amz-Credential, Authorization, ...)
_SECRET_ASSIGN = re.compile(
    r"(?<![\w-])(?P<name>[\w-]*?(?:secret|token|password|passwd|credential|access_key|"
    r"api_key|key_id|authorization|signature)[\w-]*)(?P<sep>['\"]?[ \t]*[=:][ \t]*)"
    r"(?P<quote>['\"]?)(?P<scheme>(?-i:Bearer|Basic|Digest|Token|\*\*\*)[ \t]+)?"
    r"(?P<value>[^\s'\",}&{\[(<][^\s'\",}&]*)", re.I)


# words and names: Unable, NoCredentialsError, AWS_PROFILE, aws_secret_access_key (but
# not AKIAIOSFODNNEXAMPLE: 16 capitals in a row are a key id)
_WORDS = re.compile(r"[A-Z]?[a-z]+(?:[A-Z][a-z]+)*|[a-z]+(?:_[a-z]+)+|[A-Z]{1,15}|[A-Z]+(?:_[A-Z]+)+")


def _looks_like_a_key(value: str) -> bool:
    """A word after ``name: `` in prose (``Unable``, ``see``) is no secret; a key is."""
    value = value.rstrip(".;:!?)")
    return len(value) >= 6 and (any(c.isdigit() for c in value) or any(c in "+/=" for c in value)
                                or not _WORDS.fullmatch(value))


_NAME_FOLLOWS = re.compile(r"['\"]?[ \t]*[=:]")


def _is_prose(match: re.Match[str]) -> bool:
    """"NoCredentialsError: Unable to locate credentials", "refresh your token: see the
    docs" are sentences; "token: 5b2c8d9e", "Authorization: Bearer x", "secret=x" are not."""
    name, sep, quote, scheme, value = match.group("name", "sep", "quote", "scheme", "value")
    prose = ":" in sep and sep.endswith((" ", "\t")) and not quote and not sep.startswith(("'", '"'))
    return prose and not _looks_like_a_key(value) and not (
        scheme and name.lower().endswith("authorization"))


def _hide_assigned(text: str) -> str:
    out, pos = [], 0
    while (match := _SECRET_ASSIGN.search(text, pos)) is not None:
        # keep prose, and a "value" that is the next name ("credentials: 'secret': 'x'"),
        # then look again right after "name: "
        if _is_prose(match) or match["value"].endswith(":") or _NAME_FOLLOWS.match(text, match.end()):
            out.append(text[pos:match.end("sep")])
            pos = match.end("sep")
        else:
            out.append(f"{text[pos:match.start('quote')]}{match['quote']}***")
            pos = match.end()
    out.append(text[pos:])
    return "".join(out)


def register_secrets(options: Any, name: str = "") -> None:
    """Remembers credential values found in storage options so redact() can hide them."""
    if isinstance(options, Mapping):
        for key, value in options.items():
            register_secrets(value, str(key))
    elif isinstance(options, (list, tuple)):
        for value in options:
            register_secrets(value, name)
    elif isinstance(options, str) and _SECRET_NAME.search(name) and len(options) >= 4:
        with _SECRETS_LOCK:
            _SECRETS.add(options)
            _SECRETS.update(part for part in options.split()
                            if len(part) >= 6 and part.lower() not in _AUTH_SCHEMES)


def redact(text: str) -> str:
    """Removes credentials from a message.

    Hides values of secret-like storage options seen by this process (keys, secrets,
    tokens, passwords, auth headers), ``user:password@`` in URLs, signed query
    parameters (``X-Amz-Signature``, ``sig``, ``token``, ...) and the values of
    ``secret=...``, ``"token": "..."``, ``Authorization: Bearer ...`` assignments.
    Sentences about credentials stay as they are: in ``name: value`` prose only a value
    that looks like a key (digits, ``+/=``, random case) is hidden, so
    ``NoCredentialsError: Unable to locate credentials`` keeps every word.

    Args:
        text: Any message, URL or exception text.

    Returns:
        The text with each credential replaced by ``***``.
    """
    text = str(text)
    with _SECRETS_LOCK:
        secrets = sorted(_SECRETS, key=len, reverse=True)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, "***")
    text = _USERINFO.sub(r"\1***@", text)
    text = _SIGNED_PARAM.sub(r"\1***", text)
    return _hide_assigned(text)
