"""Shared test set-up: tools/ on sys.path (servers, fault proxy, bench references), and
``producer_corpus``: the same kinds of samples written by every tar producer this
machine can run (wds_pad.cli.synth.PRODUCERS), with webdataset's reading as the oracle."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

from wds_pad.cli.synth import available_producers, write_samples  # noqa: E402

# Hypothesis: CI runs the invariant properties with their full example counts.
try:
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, print_blob=True)
    settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass


#: Producers that store a path only in ustar fields: at most 255 bytes, split at a "/".
USTAR_PRODUCERS = ("tarfile-ustar", "gnutar-ustar")
#: Producers that write pax headers, so can store non-ASCII paths as UTF-8 records.
PAX_PRODUCERS = ("webdataset", "wds-shardwriter", "tarfile-pax", "gnutar-posix")
#: Payload sizes around tar block and read-path boundaries (256 KiB takes another path).
EDGE_SIZES = (0, 1, 511, 512, 513, 1023, 4096, 262_143, 262_144, 262_145, 280_000, 300_000)


@dataclass(frozen=True)
class ProducerCorpus:
    """Shards one producer wrote, and the samples they hold.

    Attributes:
        producer: The name in ``PRODUCERS``.
        urls: The shard paths, in order.
        shards: Each shard's sample dicts (``__key__`` and member bytes), in order.
        samples: All of ``shards``, back to back: what ``wds.WebDataset`` must yield.
    """

    producer: str
    urls: list[str]
    shards: list[list[dict[str, bytes | str]]]
    samples: list[dict[str, bytes | str]]


def corpus_key(i: int, producer: str) -> str:
    """Sample ``i``'s key: plain, long (a deep directory, > 100 bytes; > 255 where the
    producer can store it), dotted directories, non-ASCII (pax producers), a long
    basename without a directory (not ustar: it cannot be split)."""
    ustar, pax = producer in USTAR_PRODUCERS, producer in PAX_PRODUCERS
    kind = i % 6
    if kind == 1:  # ~140 bytes: ustar splits it into prefix + name
        return "deep/" + "/".join(f"level{j:02d}" for j in range(16)) + f"/{i:06d}"
    if kind == 3 and not ustar and i % 4 == 3:  # ~300 bytes: beyond ustar's 255
        return "deeper/" + "/".join(f"directory-{j:02d}" for j in range(22)) + f"/{i:06d}"
    if kind == 2:
        return f"a.b/c.d/{i:06d}"
    if kind == 4 and pax:
        return f"caf\u00e9/\u00fcber-\u03bb-{i:06d}"
    if kind == 5 and not ustar:
        return "n" * 110 + f"{i:06d}"
    if kind == 4:
        return f"dir.v1/sub/{i:06d}"
    return f"{i:06d}"


def corpus_shards(producer: str, shards: int = 3, per_shard: int = 30, seed: int = 0) -> list[list[dict]]:
    """The corpus's samples, per shard: 2 members (payload and ``json``) or 3 (and
    ``cls``), members not always in extension order, payloads of 0 bytes to ~300 KB
    (every :data:`EDGE_SIZES` at least once)."""
    rng = np.random.default_rng(seed)
    total = shards * per_shard
    sizes = rng.integers(0, 20_000, size=total)
    spots = rng.choice(total, size=len(EDGE_SIZES), replace=False)
    sizes[spots] = EDGE_SIZES
    out: list[list[dict]] = []
    for s in range(shards):
        shard = []
        for i in range(s * per_shard, (s + 1) * per_shard):
            width, height = ((4, 3), (1, 1), (3, 4))[i % 3]
            meta = json.dumps({"width": width * 16, "height": height * 16, "i": i}).encode()
            payload = rng.bytes(int(sizes[i]))
            ext = "jpg" if i % 2 else "bin"
            members = {ext: payload, "json": meta} if i % 5 else {"json": meta, ext: payload}
            if i % 4 == 0:
                members["cls"] = str(i % 10).encode()
            shard.append({"__key__": corpus_key(i, producer), **members})
        out.append(shard)
    return out


@pytest.fixture(scope="session", params=available_producers(), ids=lambda p: p)
def producer_corpus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ProducerCorpus:
    """3 shards x 30 samples written by one producer (every available one in turn)."""
    producer = request.param
    shards = corpus_shards(producer)
    urls = write_samples(tmp_path_factory.mktemp(f"corpus-{producer}"), shards, producer)
    return ProducerCorpus(producer, urls, shards, [s for shard in shards for s in shard])
