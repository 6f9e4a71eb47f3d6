"""Tests of wds_pad.index.buckets.user: bucket maps (files, URLs, in memory) and user callables."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from wds_pad.errors import BucketError, ConfigError
from wds_pad.index.buckets import MappingBuckets, wrap_callable


def meta(**fields: object) -> dict[str, bytes]:
    return {"json": json.dumps(fields).encode()}


# --- mappings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("m.json", '{"a": "x", "b/c": 3, "d": null}'),
        ("m.tsv", "# key\tbucket\na\tx\n\nb/c\t3\n"),
        ("m.csv", 'a,x\n"b/c",3\n'),
        ("m.txt", "\ufeffa\tx\r\nb/c\t3\r\n"),
    ],
)
def test_mapping_file_formats(tmp_path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    fn = MappingBuckets(str(path))
    assert fn.members == () and fn.head_bytes is None
    assert fn("a", {}) == "x"
    assert fn("b/c", {}) in (3, "3")
    assert fn("d", {}) is None and fn("nope", {}) is None
    desc = fn.describe()
    assert desc["source"] == str(path) and desc["kind"] == "map" and len(desc["sha256"]) == 64
    assert MappingBuckets(path.as_uri())("a", {}) == "x"  # fsspec URL


def test_mapping_in_memory_and_digest() -> None:
    one, two = MappingBuckets({"a": "x"}), MappingBuckets({"a": "y"})
    assert one("a", {}) == "x" and one.describe()["source"] is None
    assert one.describe()["sha256"] != two.describe()["sha256"]
    assert MappingBuckets({"a": np.int64(4)})("a", {}) == 4


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a\tx\nb\ty\tz\n", "data line 2: expected"),
        ("a\tx\na\ty\n", "key 'a' maps to both 'x' and 'y'"),
        ("# only a comment\n", "non-empty"),
        ("{bad json", "not valid JSON"),
        ("[1, 2]", "non-empty"),
        ('{"a": true}', "bucket key True of type bool"),
    ],
)
def test_mapping_file_errors(tmp_path, text: str, needle: str) -> None:
    path = tmp_path / "m.tsv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        MappingBuckets(str(path))


def test_mapping_missing_file_names_it(tmp_path) -> None:
    missing = tmp_path / "absent.tsv"
    with pytest.raises(ConfigError, match="cannot read bucket map .*absent.tsv") as err:
        MappingBuckets(str(missing))
    assert isinstance(err.value.__cause__, OSError)
    with pytest.raises(ConfigError):
        MappingBuckets(42)  # type: ignore[arg-type]


# --- user callables --------------------------------------------------------------------


def lang_of(key: str, data: dict[str, bytes]) -> str | None:
    return json.loads(data["json"]).get("lang")


def test_wrap_callable_receives_raw_bytes() -> None:
    seen: list[tuple[str, dict]] = []

    def spy(key: str, data: dict[str, bytes]) -> str:
        seen.append((key, dict(data)))
        return "b"

    fn = wrap_callable(spy, members=("json", "txt"), head_bytes=128)
    assert fn.members == ("json", "txt") and fn.head_bytes == 128
    assert fn("k1", {"json": b'{"a": 1}', "txt": b"hi"}) == "b"
    assert seen == [("k1", {"json": b'{"a": 1}', "txt": b"hi"})]
    assert isinstance(seen[0][1]["json"], bytes)


def test_wrap_callable_results_and_pickling() -> None:
    fn = wrap_callable(lang_of)
    assert fn("k", meta(lang="fr")) == "fr"
    assert fn("k", meta()) is None
    assert fn.describe() == {"kind": "callable", "function": f"{__name__}.lang_of", "members": ["json"], "head_bytes": None}
    assert pickle.loads(pickle.dumps(fn))("k", meta(lang="it")) == "it"
    assert wrap_callable(lambda k, d: np.int32(3))("k", {}) == 3
    assert type(wrap_callable(lambda k, d: np.float32(0.5))("k", {})) is float


def test_wrap_callable_errors_name_the_key() -> None:
    def boom(key: str, data: dict) -> str:
        raise KeyError("width")

    with pytest.raises(BucketError, match=r"sample 's/9': bucket function .*boom raised KeyError: 'width'") as err:
        wrap_callable(boom)("s/9", {})
    assert isinstance(err.value.__cause__, KeyError)
    with pytest.raises(BucketError, match="sample 's/1': bucket key True of type bool"):
        wrap_callable(lambda k, d: True)("s/1", {})
    with pytest.raises(BucketError, match="not a str, int or float"):
        wrap_callable(lambda k, d: ("a", 1))("s/2", {})
    with pytest.raises(BucketError, match="not finite"):
        wrap_callable(lambda k, d: float("inf"))("s/3", {})


@pytest.mark.parametrize(
    ("args", "needle"),
    [(("not callable",), "callable"), ((lang_of, "json"), "string 'json'"), ((lang_of, ("json",), 0), "positive int")],
)
def test_wrap_callable_config_errors(args: tuple, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        wrap_callable(*args)
