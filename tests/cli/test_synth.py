"""Tests of wds_pad.cli.synth and tools/make_shards.py: shards read back by webdataset."""

from __future__ import annotations

import collections
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from wds_pad.cli.synth import DEFAULT_RATIOS, DEFAULT_SKEW, make_blob_shards, make_image_shards
from wds_pad.index.buckets import AspectBuckets, ImageBuckets, image_size
from wds_pad.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SYNTH_LABELS = [f"{w}:{h}" for w, h in DEFAULT_RATIOS]


def read_back(paths: list[str]) -> list[dict]:
    return list(wds.WebDataset(paths, shardshuffle=False, empty_check=False))


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return make_image_shards(tmp_path_factory.mktemp("img"), samples=300, shards=6, seed=3)


def test_image_shards_counts_and_skew(image_shards: list[str]) -> None:
    assert [Path(p).name for p in image_shards] == [f"shard-{i:06d}.tar" for i in range(6)]
    samples = read_back(image_shards)
    assert len(samples) == 300
    assert len({s["__key__"] for s in samples}) == 300
    per_shard = collections.Counter(s["__url__"] for s in samples)
    assert sorted(per_shard) == sorted(image_shards) and len(set(per_shard.values())) > 1  # uneven
    ratios = collections.Counter(json.loads(s["json"])["ratio"] for s in samples)
    # 55/25/12/6/2 % of 300, exactly
    assert [ratios[label] for label in SYNTH_LABELS] == [165, 75, 36, 18, 6]
    assert not [f for f in os.listdir(Path(image_shards[0]).parent) if not f.endswith(".tar")]  # no temp files


def test_image_shards_are_real_images_with_matching_metadata(image_shards: list[str]) -> None:
    by_json, by_image = AspectBuckets(ratios=SYNTH_LABELS), ImageBuckets(ratios=SYNTH_LABELS)
    formats = collections.Counter()
    for sample in read_back(image_shards):
        info = json.loads(sample["json"])
        ext = info["format"]
        formats[ext] += 1
        assert set(sample) - {"__key__", "__url__", "__local_path__"} == {ext, "json"}
        pil = Image.open(io.BytesIO(sample[ext]))
        assert pil.size == (info["width"], info["height"]) == image_size(sample[ext])
        assert pil.format == {"png": "PNG", "jpg": "JPEG"}[ext]
        rw, rh = map(int, info["ratio"].split(":"))
        assert info["width"] * rh == info["height"] * rw  # the exact ratio, not just the nearest
        assert 8 <= min(pil.size) and max(pil.size) <= 64
        assert 0 <= info["label"] < 10
        assert by_json(sample["__key__"], sample) == by_image(sample["__key__"], sample) == info["ratio"]
    assert set(formats) == {"png", "jpg"}


def test_image_shards_are_deterministic(tmp_path: Path) -> None:
    first = make_image_shards(tmp_path / "a", samples=40, shards=3, seed=7)
    again = make_image_shards(tmp_path / "b", samples=40, shards=3, seed=7)
    other = make_image_shards(tmp_path / "c", samples=40, shards=3, seed=8)
    content = [Path(p).read_bytes() for p in first]
    assert content == [Path(p).read_bytes() for p in again]
    assert content != [Path(p).read_bytes() for p in other]


def test_image_shards_custom_layout(tmp_path: Path) -> None:
    paths = make_image_shards(
        tmp_path, samples=20, shards=20, ratios=((2, 1), (1, 3)), skew=(3, 1), formats=("webp",)
    )
    samples = read_back(paths)
    assert len(paths) == 20 and len(samples) == 20  # one sample per shard
    assert collections.Counter(json.loads(s["json"])["ratio"] for s in samples) == {"2:1": 15, "1:3": 5}
    assert all(Image.open(io.BytesIO(s["webp"])).format == "WEBP" for s in samples)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"samples": 3, "shards": 4}, "every shard needs at least one sample"),
        ({"samples": 0}, "samples must be a positive int"),
        ({"skew": (1, 1)}, "equal length"),
        ({"skew": (1, 0, 0, 0, -1)}, "non-negative"),
        ({"ratios": ((1, 0),), "skew": (1,)}, "positive ints"),
        ({"formats": ("gif",)}, "subset of png, jpg"),
    ],
)
def test_image_shards_config_errors(tmp_path: Path, kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make_image_shards(tmp_path, **kwargs)


def test_blob_shards(tmp_path: Path) -> None:
    paths = make_blob_shards(tmp_path, samples=500, sample_bytes=2000, shards=4, seed=1)
    samples = read_back(paths)
    assert len(samples) == 500 and len(paths) == 4
    assert len(set(collections.Counter(s["__url__"] for s in samples).values())) > 1
    aspect = AspectBuckets(ratios=SYNTH_LABELS)
    buckets = collections.Counter()
    payloads = set()
    for sample in samples:
        info = json.loads(sample["json"])
        payload = sample["bin"]
        assert int.from_bytes(payload[:8], "little") == info["index"] == int(sample["__key__"])
        assert len(payload) == info["nbytes"] and 1800 <= len(payload) <= 2200
        payloads.add(payload[8:64])
        buckets[aspect(sample["__key__"], sample)] += 1
    assert [buckets[label] for label in SYNTH_LABELS] == [round(500 * s) for s in DEFAULT_SKEW]
    assert len(payloads) == 500  # random, not repeated
    assert make_blob_shards(tmp_path / "again", samples=500, sample_bytes=2000, shards=4, seed=1) != paths
    assert [Path(p).read_bytes() for p in paths] == [
        Path(p).read_bytes() for p in make_blob_shards(tmp_path / "b", samples=500, sample_bytes=2000, shards=4, seed=1)
    ]


def test_blob_shards_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sample_bytes must be an int >= 16"):
        make_blob_shards(tmp_path, samples=10, sample_bytes=4, shards=1)
    with pytest.raises(ConfigError, match="shards must be a positive int"):
        make_blob_shards(tmp_path, samples=10, sample_bytes=100, shards=0)


def load_tool():
    spec = importlib.util.spec_from_file_location("make_shards_tool", REPO / "tools" / "make_shards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_shards_tool_runs_standalone(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tool finds the checkout itself
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_shards.py"), "images", str(tmp_path), "--samples", "30",
         "--shards", "3", "--formats", "png"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    paths = done.stdout.split()
    assert len(paths) == 3 and "wrote 3 images shards" in done.stderr
    assert {json.loads(s["json"])["format"] for s in read_back(paths)} == {"png"}


def test_make_shards_tool_blobs_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_tool()
    assert tool.main(["blobs", str(tmp_path / "b"), "--samples", "50", "--shards", "2", "--sample-bytes", "100"]) == 0
    paths = capsys.readouterr().out.split()
    samples = read_back(paths)
    assert len(paths) == 2 and len(samples) == 50 and all(90 <= len(s["bin"]) <= 111 for s in samples)

    assert tool.main(["images", str(tmp_path / "bad"), "--samples", "2", "--shards", "5"]) == 2
    assert "every shard needs at least one sample" in capsys.readouterr().err


def _samples(paths: list[str]) -> list[dict]:
    return [{k: v for k, v in s.items() if k == "__key__" or not k.startswith("__")} for s in read_back(paths)]


def test_image_shards_same_samples_whatever_the_producer(tmp_path: Path) -> None:
    written = {p: make_image_shards(tmp_path / p, samples=24, shards=3, seed=4, producer=p)
               for p in ("webdataset", "tarfile-ustar", "tarfile-gnu")}
    reference = _samples(written["webdataset"])
    assert len(reference) == 24
    for producer, paths in written.items():
        assert [Path(p).name for p in paths] == [f"shard-{i:06d}.tar" for i in range(3)]
        assert _samples(paths) == reference, producer
    assert Path(written["webdataset"][0]).read_bytes() != Path(written["tarfile-ustar"][0]).read_bytes()
    with pytest.raises(ConfigError, match="unknown producer 'pax'"):
        make_image_shards(tmp_path / "bad", samples=4, shards=1, producer="pax")


def test_make_shards_tool_producer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_tool()
    argv = ["blobs", str(tmp_path / "u"), "--samples", "20", "--shards", "2", "--sample-bytes", "100"]
    assert tool.main([*argv, "--producer", "tarfile-ustar"]) == 0
    out = capsys.readouterr()
    paths = out.out.split()
    assert "(tarfile-ustar)" in out.err
    first = Path(paths[0]).read_bytes()
    assert first[156:157] == b"0" and first[257:265] == b"ustar\x0000"  # a plain ustar header first
    assert tool.main([*argv[:1], str(tmp_path / "w"), *argv[2:]]) == 0  # default: webdataset's TarWriter
    assert Path(capsys.readouterr().out.split()[0]).read_bytes()[156:157] == b"x"  # a pax header first
    with pytest.raises(SystemExit):
        tool.main([*argv, "--producer", "zip"])
    assert "invalid choice: 'zip'" in capsys.readouterr().err
