"""Chaos run of the node cache's promise: a job with a warm cache streams the same bytes, or
raises the same error, as the same job without one.

Shards are served over loopback HTTP (nginx, or the Python fallback, behind the FaultProxy).
Each job is a process of its own (``wds_pad.Loader`` with 2 DataLoader workers,
``locality="shard"``, a ``cache_dir``) that writes, per sample key, a digest of its members,
or the error it ended in (class and text). The reference is the same job without a cache
(``locality="none"``: one ranged GET per sample, nothing kept). Scenarios, on one cache folder:

* the store rewritten between jobs: new bytes of the same size and a new mtime (a new ETag),
  old index; new bytes keeping size and mtime (the same ETag), index built again; a new size;
* the store rewritten during a job (between its first and last shard);
* cached files damaged (64 bytes flipped), a cached file replaced by a directory;
* the folder read-only (a read-only bind mount, as root) with every shard in it, and without;
* the folder's disk full (a small tmpfs, as root);
* connections dropped mid-body and reset (the FaultProxy);
* ``--kills`` jobs killed with SIGKILL at a random moment, each followed by a full job.

It reports the samples that differ from the reference (bytes, or a sample one has and the
other not) plus the jobs whose error differs in class, and the tracebacks printed on stderr
by any job, its workers included (a killed job's orphaned workers too); both should be 0.
A full disk or a read-only folder lacking a shard must end in one ``ConfigError`` line.

Usage::

    python tools/cachechaos.py [--kills 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def job(index: str, cache: str, out: str, locality: str) -> None:
    """One job: every sample's member digests by key, or its error, to ``out``."""
    import wds_pad
    from wds_pad import BucketedWebDataset, Loader, ReadOptions, Topology

    opts = ReadOptions(block_bytes=16 * 1024, cache_dir=cache or None, retries=6, backoff=0.01, backoff_max=0.05)
    result: dict[str, Any]
    try:
        ds = BucketedWebDataset(index, batch_size=4, topology=Topology(1, 0), seed=5, locality=locality, window=2,
                                read_options=opts, check_agreement=False)
        got = {}
        for batch in Loader(ds, num_workers=2):
            for s in batch:
                got[s["__key__"]] = hashlib.blake2b(b"".join(
                    k.encode() + s[k] for k in sorted(s) if not k.startswith("__") and isinstance(s[k], bytes)),
                    digest_size=8).hexdigest()
        result = {"samples": got}
    except wds_pad.WdsPadError as exc:
        result = {"error": type(exc).__name__, "text": str(exc).splitlines()[0] if str(exc) else ""}
    Path(out).write_text(json.dumps(result))


class Chaos:
    def __init__(self, root: Path, base: str, served: Path) -> None:
        self.root, self.base, self.served = root, base, served
        self.n = 0
        self.differing = self.tracebacks = self.error_class = 0
        self.lines: list[str] = []

    def index(self) -> str:
        from wds_pad.index.build import build_index

        self.n += 1
        out = self.root / f"ix{self.n}.wdsidx"
        names = sorted(p.name for p in self.served.glob("*.tar"))
        build_index([f"{self.base}/{n}" for n in names], "aspect:width,height", output=str(out))
        return str(out)

    def start(self, index: str, cache: Path | None) -> tuple[subprocess.Popen[bytes], Path]:
        self.n += 1
        out = self.root / f"out{self.n}.json"
        proc = subprocess.Popen([sys.executable, __file__, "--job", index, str(cache or ""), str(out),
                                 "shard" if cache else "none"], stderr=subprocess.PIPE, start_new_session=True)
        return proc, out

    def run(self, index: str, cache: Path | None) -> dict[str, Any]:
        proc, out = self.start(index, cache)
        _, err = proc.communicate(timeout=300)
        self.count_tracebacks(err)
        return json.loads(out.read_text()) if out.exists() else {"error": f"exit {proc.returncode}", "text": ""}

    def count_tracebacks(self, err: bytes) -> None:
        text = err.decode("utf-8", "replace")
        found = text.count("Traceback (most recent call last)") + text.count("exception calling callback") \
            + text.count("cannot schedule new futures")
        if found:
            self.lines.append("stderr: " + text.strip().splitlines()[-1][:200])
        self.tracebacks += found

    def compare(self, what: str, index: str, cache: Path, expect_error: str | None = None) -> None:
        ref, got = self.run(index, None), self.run(index, cache)
        if expect_error is not None:
            ok = got.get("error") == expect_error
            self.error_class += not ok
            self.lines.append(f"{what}: {got.get('error')} {'(as required)' if ok else '(expected ' + expect_error + ')'}"
                              f" {got.get('text', '')[:160]}")
            return
        if "error" in ref or "error" in got:
            same = ref.get("error") == got.get("error")
            self.error_class += not same
            self.lines.append(f"{what}: without cache {ref.get('error', 'streams')}, with {got.get('error', 'streams')}"
                              f"{'' if same else '  <-- differs'}")
            return
        a, b = ref["samples"], got["samples"]
        diff = sum(a.get(k) != b.get(k) for k in set(a) | set(b))
        self.differing += diff
        self.lines.append(f"{what}: {len(b)} samples, {diff} differ from the job without a cache")


def rewrite(path: Path, keep_mtime: bool, grow: bool = False) -> None:
    """New payload bytes (the layout kept), or one more member appended (a new size)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            if m.size >= 64 and not m.name.endswith(".json"):
                off = m.offset_data + m.size // 2
                data[off:off + 16] = bytes(b ^ 0x33 for b in data[off:off + 16])
    if grow:
        data = data[:-1024] + bytes(512 * 20 + 1024)  # trailing zero blocks: a longer archive
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@contextlib.contextmanager
def mounted(kind: str, folder: Path, view: Path, size: int = 0) -> Iterator[Path | None]:
    if os.geteuid() != 0:
        yield None
        return
    view.mkdir(exist_ok=True)
    if kind == "ro":
        subprocess.run(["mount", "--bind", str(folder), str(view)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
    else:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(view)], check=True)
    try:
        yield view
    finally:
        subprocess.run(["umount", "--lazy", str(view)], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--job", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        job(*args.job)
        return 0
    from faultproxy import FaultProxy, StallMode
    from servers import http_server
    from wds_pad.cli.synth import make_image_shards

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="wds_pad_cachechaos_"))
    served = root / "www" / "data"
    served.mkdir(parents=True)
    for i, p in enumerate(make_image_shards(root / "gen", samples=120, shards=6, seed=3)):
        os.replace(p, served / f"train-{i:06d}.tar")
    with http_server(root / "www") as server:
        proxy = FaultProxy(server.host, server.port).start()
        base = f"http://{proxy.host}:{proxy.port}/data"
        c = Chaos(root, base, served)
        cache = root / "cache"
        index = c.index()
        c.compare("cold cache", index, cache)
        c.compare("warm cache", index, cache)
        rewrite(served / "train-000001.tar", keep_mtime=False)
        c.compare("store rewritten (same size, new mtime), old index", index, cache)
        index = c.index()
        c.compare("  then indexed again", index, cache)
        rewrite(served / "train-000002.tar", keep_mtime=True)
        index = c.index()
        c.compare("store rewritten (same size and mtime), indexed again", index, cache)
        rewrite(served / "train-000003.tar", keep_mtime=False, grow=True)
        c.compare("store rewritten (new size), old index", index, cache)
        index = c.index()
        c.compare("  then indexed again", index, cache)
        # during a job: the rewrite lands while it streams
        proc, out = c.start(index, cache)
        time.sleep(rng.uniform(0.5, 2.0))
        rewrite(served / "train-000004.tar", keep_mtime=False)
        _, err = proc.communicate(timeout=300)
        c.count_tracebacks(err)
        c.lines.append(f"store rewritten during a job: "
                       f"{json.loads(out.read_text()).get('error', 'streamed') if out.exists() else 'no result'}")
        index = c.index()
        c.compare("  then indexed again", index, cache)
        for copy in sorted(cache.glob("*.shard"))[::2]:
            data = bytearray(copy.read_bytes())
            data[3000:3064] = bytes(b ^ 0xFF for b in data[3000:3064])
            copy.write_bytes(bytes(data))
        c.compare("cached files damaged", index, cache)
        odd = sorted(cache.glob("*.shard"))[0]
        for p in cache.glob(odd.stem + ".*"):
            p.unlink()
        (cache / ("0" * 32 + "-100.shard")).mkdir()
        c.compare("a foreign directory in the folder", index, cache)
        with mounted("ro", cache, root / "ro") as ro:
            if ro is not None:
                c.compare("read-only folder, every shard in it", index, ro)
        for p in sorted(q for q in cache.glob("*.shard") if q.is_file())[:2]:
            p.unlink()
        with mounted("ro", cache, root / "ro2") as ro:
            if ro is not None:
                c.compare("read-only folder lacking shards", index, ro, expect_error="ConfigError")
        largest = max(p.stat().st_size for p in served.glob("*.tar"))
        with mounted("tmpfs", cache, root / "small", size=largest * 3 // 2) as small:
            if small is not None:
                c.compare("full disk", index, small, expect_error="ConfigError")
        proxy.stall_next(4, mode=StallMode.CUT, match=lambda r: r.header("range") is not None)
        proxy.reset_next(4, match=lambda r: r.header("range") is not None)
        fresh = root / "fresh"
        c.compare("connections dropped and reset", index, fresh)
        proxy.clear_faults()
        killed = root / "killed"
        before = c.differing
        for k in range(args.kills):
            proc, _ = c.start(index, killed)
            time.sleep(rng.uniform(1.0, 4.0))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL) if rng.random() < 0.5 else os.kill(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=300)
            c.count_tracebacks(err)
            time.sleep(0.5)  # orphaned workers notice their parent is gone
            ref, got = c.run(index, None), c.run(index, killed)
            if "error" in got or "error" in ref:
                c.error_class += ref.get("error") != got.get("error")
                continue
            a, b = ref["samples"], got["samples"]
            c.differing += sum(a.get(x) != b.get(x) for x in set(a) | set(b))
        c.lines.append(f"{args.kills} kills, each then a full job: {c.differing - before} samples differ")
        proxy.stop()
    for line in c.lines:
        print(line)
    print(f"samples differing from the job without a cache: {c.differing}; jobs ending in another error class: "
          f"{c.error_class}; tracebacks on stderr: {c.tracebacks}")
    return 0 if c.differing == c.error_class == c.tracebacks == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
