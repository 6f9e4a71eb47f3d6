"""Shards that moved: URLs stored relative to the index, resolved where it is loaded, and
``relocate`` for shards outside its folder; the stale check, workers and resume across a move.

A dataset folder (the index beside its shards) is built in one place, moved whole, and
loaded, streamed and resumed in the other; the same over S3 (a bucket copied to another
bucket). Shards outside the index's folder are moved with ``relocate`` (Python) and
``--relocate`` (CLI). Every stream is compared with the plan and with webdataset's bytes.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import pytest

from data_helpers import assert_same_bytes, batch_keys, make_dataset, plan_keys, wds_reference
from wds_pad import ShardStream, Topology, build_index, load_index, write_index
from wds_pad.cli.app import main as cli_main
from wds_pad.cli.synth import make_image_shards
from wds_pad.errors import ConfigError, StaleShardError
from wds_pad.index.location import check_relocation, index_folder, resolve_url, store_url
from wds_pad.stream.loader import Loader

pytest_plugins = ["conftest_servers"]

pytestmark = [pytest.mark.filterwarnings("ignore::wds_pad.errors.DroppedBucketWarning"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

BUCKET_BY = "aspect:width,height"


def _folder(root: Path, seed: int = 3) -> tuple[Path, list[str], str]:
    """A dataset folder: ``root/shards/*.tar`` and ``root/train.wdsidx`` beside them."""
    shards = make_image_shards(root / "shards", samples=60, shards=4, seed=seed)
    out = str(root / "train.wdsidx")
    build_index(shards, BUCKET_BY, output=out)
    return root, shards, out


def _raw_shard_table(path: str) -> list[dict]:
    index = load_index(path)
    return json.loads(bytes(index.json_blobs()["shards"]))


# -- storing and resolving ------------------------------------------------------------------


def test_urls_beside_or_below_are_stored_relative_and_resolve_back(tmp_path) -> None:
    assert index_folder("/data/x/train.wdsidx") == "/data/x/"
    assert index_folder("s3://b/data/train.wdsidx") == "s3://b/data/"
    assert index_folder("https://host/d/i.wdsidx?sig=1/2") == "https://host/d/"
    assert store_url("/data/x/shards/a.tar", "/data/x/") == "shards/a.tar"
    assert store_url("/data/x/a.tar", "/data/x/") == "a.tar"
    assert store_url("/data/xy/a.tar", "/data/x/") == "/data/xy/a.tar"  # not below: a sibling folder
    assert store_url("/data/a.tar", "/data/x/") == "/data/a.tar"  # above: never '..'
    assert store_url("s3://b/data/shards/a.tar", "s3://b/data/") == "shards/a.tar"
    assert store_url("s3://other/data/a.tar", "s3://b/data/") == "s3://other/data/a.tar"
    assert store_url("https://host/d/a.tar?sig=x", "https://host/d/") == "a.tar?sig=x"
    for url, folder in (("/data/x/shards/a.tar", "/data/x/"), ("s3://b/data/a.tar", "s3://b/data/")):
        assert resolve_url(store_url(url, folder), folder) == url
    assert resolve_url("shards/a.tar", "/new/place/") == "/new/place/shards/a.tar"
    assert resolve_url("/abs/a.tar", "/new/place/") == "/abs/a.tar"
    moves = check_relocation({"file:///mnt/a/": "/mnt/b", "s3://old/": "s3://new", "/mnt/a/x": "/elsewhere"})
    assert moves == (("/mnt/a/x", "/elsewhere"), ("s3://old", "s3://new"), ("/mnt/a", "/mnt/b"))  # longest first
    assert resolve_url("/mnt/a/x/1.tar", None, moves) == "/elsewhere/1.tar"
    assert resolve_url("/mnt/a/y/1.tar", None, moves) == "/mnt/b/y/1.tar"
    assert resolve_url("/mnt/ab/1.tar", None, moves) == "/mnt/ab/1.tar"  # whole path components only
    assert resolve_url("s3://old/k/1.tar", None, moves) == "s3://new/k/1.tar"


def test_a_build_stores_relative_urls_and_its_digest_is_the_files(tmp_path) -> None:
    root, shards, out = _folder(tmp_path / "data")
    built = build_index(shards, BUCKET_BY, output=out)
    table = _raw_shard_table(out)
    assert [s["url"] for s in table] == [f"shards/{os.path.basename(p)}" for p in shards]
    loaded = load_index(out)
    assert list(loaded.urls) == shards and loaded.digest == built.digest
    assert list(loaded.stored_urls) == [s["url"] for s in table] and loaded.relative


def test_an_index_with_no_shard_below_it_is_written_as_before(tmp_path) -> None:
    """Shards outside the index's folder: absolute URLs, no relative flag, the bytes and
    digest of the in-memory build (what every earlier wds_pad wrote)."""
    shards = make_image_shards(tmp_path / "shards", samples=20, shards=2, seed=1)
    memory = build_index(shards, BUCKET_BY, name="train")
    out = str(tmp_path / "elsewhere" / "train.wdsidx")
    written = build_index(shards, BUCKET_BY, output=out)
    raw = Path(out).read_bytes()
    assert b"relative_urls" not in raw and [s["url"] for s in _raw_shard_table(out)] == shards
    assert written.digest == memory.digest == load_index(out).digest


def test_a_file_written_before_relative_urls_loads_as_it_always_did(tmp_path) -> None:
    """A file whose shards lie below it but whose URLs are absolute (as earlier wds_pad
    wrote every file) loads unchanged: its URLs are not read against its folder, and a
    relocation moves them."""
    from wds_pad.index.codec import serialize

    root, shards, out = _folder(tmp_path / "data")
    memory = build_index(shards, BUCKET_BY, name="train")
    Path(out).write_bytes(b"".join(bytes(p) for p in serialize(memory)))  # the old writer's bytes
    old = load_index(out)
    assert list(old.urls) == list(old.stored_urls) == shards and old.digest == memory.digest and not old.relative
    shutil.move(str(root), str(tmp_path / "moved"))
    moved = load_index(str(tmp_path / "moved" / "train.wdsidx"), relocate={str(root): str(tmp_path / "moved")})
    assert [os.path.exists(u) for u in moved.urls] == [True] * len(shards) and moved.digest == memory.digest


def test_an_index_built_in_memory_is_stored_relative_to_where_it_is_written(tmp_path) -> None:
    """write_index of an index without a path: relative to the file it writes (the same
    bytes as a build with that output); the in-memory index keeps its own digest."""
    root, shards, _ = _folder(tmp_path / "data")
    memory = build_index(shards, BUCKET_BY, name="copy")
    target = str(root / "copy.wdsidx")
    write_index(memory, target)
    again = build_index(shards, BUCKET_BY, output=str(root / "copy2.wdsidx"), name="copy")
    assert Path(target).read_bytes() == Path(root / "copy2.wdsidx").read_bytes()
    assert load_index(target).digest == memory.located(target).digest == again.digest != memory.digest
    assert memory.path is None and memory.located(target).path == target


def test_cwd_relative_urls_of_make_index_are_not_taken_for_index_relative(tmp_path, monkeypatch) -> None:
    """make_index takes any URL; a working-directory-relative one written beside a
    relative one is stored absolute, so the file never reads it against its folder."""
    from wds_pad.index.layout import stored_urls

    monkeypatch.chdir(tmp_path)
    urls, relative = stored_urls([str(tmp_path / "d" / "a.tar"), "b.tar"], str(tmp_path / "d") + "/")
    assert relative and urls == ["a.tar", str(tmp_path / "b.tar")]
    assert stored_urls(["b.tar"], str(tmp_path / "d") + "/") == (["b.tar"], False)


# -- a folder moved whole -------------------------------------------------------------------


def test_a_moved_folder_loads_streams_and_resumes_a_state_saved_before_the_move(tmp_path) -> None:
    root, shards, out = _folder(tmp_path / "a" / "data")
    reference = wds_reference(shards)

    def make(path: str) -> object:
        return make_dataset(path, seed=4, quiet=True)

    before = make(out)
    full = batch_keys(Loader(make(out), num_workers=2))
    assert full == plan_keys(before.plan(), load_index(out))
    loader = Loader(make(out), num_workers=2)
    it = iter(loader)
    head = batch_keys(itertools.islice(it, 3))
    state = loader.state_dict()
    del it

    moved = tmp_path / "b" / "mnt" / "data"
    moved.parent.mkdir(parents=True)
    shutil.move(str(root), str(moved))  # a rename: sizes and mtimes as indexed
    new_out = str(moved / "train.wdsidx")
    index = load_index(new_out)
    assert all(u.startswith(str(moved) + "/shards/") for u in index.urls)
    assert index.digest == load_index(new_out).digest and make(new_out).spec.fingerprint() == before.spec.fingerprint()
    resumed = Loader(make(new_out), num_workers=2)  # workers reload the index from its new path
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert head + batch_keys(rest) == full
    assert_same_bytes(rest, {k: v for k, v in reference.items()})


def test_shard_stream_resumes_across_a_move(tmp_path) -> None:
    """The shard-level stream deals and fingerprints shards by their URLs as stored:
    a state saved before the move resumes after it, on the same samples."""
    root, shards, out = _folder(tmp_path / "a" / "data")
    solo = Topology(world_size=1, rank=0)
    first = ShardStream(out, topology=solo, seed=5)
    full = [s["__key__"] for s in first]
    stream = ShardStream(out, topology=solo, seed=5)
    it = iter(stream)
    head = [next(it)["__key__"] for _ in range(7)]
    state = stream.state_dict()
    del it
    moved = tmp_path / "b"
    shutil.move(str(root), str(moved))
    again = ShardStream(str(moved / "train.wdsidx"), topology=solo, seed=5)
    again.load_state_dict(state)
    assert head + [s["__key__"] for s in again] == full


# -- relocate: shards outside the index's folder ------------------------------------------


def _outside(tmp_path: Path) -> tuple[list[str], str, Path, Path]:
    """Shards in ``tmp/old``, the index in ``tmp/idx``; the shards then moved to ``tmp/new``."""
    shards = make_image_shards(tmp_path / "old", samples=40, shards=3, seed=8)
    out = str(tmp_path / "idx" / "train.wdsidx")
    build_index(shards, BUCKET_BY, output=out)
    assert [s["url"] for s in _raw_shard_table(out)] == shards  # not below the index: absolute
    shutil.move(str(tmp_path / "old"), str(tmp_path / "new"))
    return shards, out, tmp_path / "old", tmp_path / "new"


def test_relocate_moves_shards_outside_the_folder_and_keeps_the_fingerprint(tmp_path) -> None:
    shards, out, old, new = _outside(tmp_path)
    plain = load_index(out)
    index = load_index(out, relocate={str(old): str(new)})
    assert list(index.urls) == [p.replace(str(old), str(new)) for p in shards]
    assert index.stored_urls == plain.stored_urls and index.digest == plain.digest
    ds = make_dataset(out, relocate={str(old) + "/": str(new) + "/"}, seed=2, quiet=True)
    assert ds.spec.fingerprint() == make_dataset(plain, seed=2, quiet=True).spec.fingerprint()
    batches = list(Loader(ds, num_workers=2))  # the relocation travels into the workers
    assert batch_keys(batches) == plan_keys(ds.plan(), index)
    assert_same_bytes(batches, wds_reference(index.urls))


def test_relocate_refuses_a_prefix_that_matches_no_shard_and_bad_pairs(tmp_path) -> None:
    shards, out, old, new = _outside(tmp_path)
    with pytest.raises(ConfigError, match=r"relocate '/nowhere': no shard URL of index .* starts with it"):
        load_index(out, relocate={"/nowhere": str(new)})
    with pytest.raises(ConfigError, match="no shard URL.*at a path boundary.*not inside a name"):  # whole components
        load_index(out, relocate={str(old)[:-1]: str(new)})
    with pytest.raises(ConfigError, match="pair"):
        check_relocation({"": "/x"})
    with pytest.raises(ConfigError, match="map old URL prefixes"):
        check_relocation("/a=/b")
    with pytest.raises(ConfigError, match="given twice"):
        check_relocation({"/a/": "/b", "/a": "/c"})
    with pytest.raises(ConfigError, match="applies to indexes given as paths"):
        make_dataset(load_index(out, relocate={str(old): str(new)}), relocate={str(old): str(new)})


def test_a_relocated_shard_that_changed_is_refused_as_stale(tmp_path) -> None:
    shards, out, old, new = _outside(tmp_path)
    moved = [p.replace(str(old), str(new)) for p in shards]
    st = os.stat(moved[1])
    os.utime(moved[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a copy that did not keep the mtime
    ds = make_dataset(out, relocate={str(old): str(new)}, seed=1, quiet=True)
    with pytest.raises(StaleShardError, match="shard-000001.tar"):
        list(ds)


def test_cli_relocate_on_every_command_that_loads_an_index(tmp_path, capsys) -> None:
    shards, out, old, new = _outside(tmp_path)
    move = ["--relocate", f"{old}={new}"]
    assert cli_main(["verify", out]) == 1
    said = capsys.readouterr().out
    assert "MISSING" in said and f"wds-pad verify {out} --relocate OLD=NEW" in said and "folder boundary" in said
    assert cli_main(["verify", out, *move]) == 0
    assert "3 shards OK" in capsys.readouterr().out
    assert cli_main(["inspect", out, "--json", *move]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 40
    assert cli_main(["plan", out, "--world-size", "1", "--rank", "0", "--batch-size", "4", "--seed", "1",
                     "--json", *move]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows and all(u.startswith(str(new) + "/") for r in rows for u in r["urls"])
    with pytest.raises(SystemExit):  # a prefix without '='
        cli_main(["verify", out, "--relocate", str(old)])
    assert "expected OLD=NEW" in capsys.readouterr().err
    assert cli_main(["verify", out, "--relocate", f"/nowhere={new}"]) == 2
    assert "no shard URL of index" in capsys.readouterr().err
    assert cli_main(["index", *shards, "-o", out, "--relocate", f"{old}={new}"]) == 2
    assert "--relocate applies to the index --update reads" in capsys.readouterr().err


def test_index_update_relocate_is_refused_naming_relocate_and_a_saved_state_resumes_through_it(
        tmp_path, capsys) -> None:
    shards, out, old, new = _outside(tmp_path)
    before = Path(out).read_bytes()
    move = {str(old): str(new)}
    loader = Loader(make_dataset(out, relocate=move, seed=3, quiet=True), num_workers=0)
    it = iter(loader)
    head = batch_keys(itertools.islice(it, 2))
    state = loader.state_dict()
    del it
    assert cli_main(["index", "--update", "-o", out, "--no-progress", "--relocate", f"{old}={new}"]) == 2
    said = capsys.readouterr().err
    assert "changes its digest" in said and "relocate=" in said and "--relocate OLD=NEW on plan" in said
    assert Path(out).read_bytes() == before  # INDEX as it was: the state saved with it resumes
    full = batch_keys(Loader(make_dataset(out, relocate=move, seed=3, quiet=True), num_workers=0))
    resumed = Loader(make_dataset(out, relocate=move, seed=3, quiet=True), num_workers=0)
    resumed.load_state_dict(state)
    assert head + batch_keys(resumed) == full


# -- object storage: a bucket copied --------------------------------------------------------


def test_a_bucket_copied_elsewhere_streams_from_the_copy(moto_server, tmp_path) -> None:
    import s3fs

    options = moto_server.storage_options
    shards = make_image_shards(tmp_path / "s", samples=30, shards=3, seed=4)
    src, dst = moto_server.make_bucket("wds-pad-moved-src"), moto_server.make_bucket("wds-pad-moved-dst")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    for p in shards:
        fs.put_file(p, f"{src}/data/shards/{os.path.basename(p)}")
    urls = [f"s3://{src}/data/shards/{os.path.basename(p)}" for p in shards]
    out = f"s3://{src}/data/train.wdsidx"
    built = build_index(urls, BUCKET_BY, output=out, storage_options=options)
    assert b'"url": "shards/shard-000000.tar"' in fs.cat_file(out.removeprefix("s3://"))
    for name in fs.find(f"{src}/data"):  # the copy: another bucket, the same objects (and ETags)
        fs.copy(name, name.replace(src, dst, 1))
    fs.rm(f"{src}/data/shards", recursive=True)  # the originals are gone: reads must go to the copy
    copied = f"s3://{dst}/data/train.wdsidx"
    index = load_index(copied, storage_options=options)
    assert list(index.urls) == [u.replace(src, dst) for u in urls] and index.digest == built.digest
    ds = make_dataset(copied, storage_options=options, seed=3, quiet=True)
    batches = list(ds)
    assert batch_keys(batches) == plan_keys(ds.plan(), index)
    assert_same_bytes(batches, wds_reference(shards))
