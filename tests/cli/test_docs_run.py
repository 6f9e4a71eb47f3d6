"""Every Python and shell block of README.md and docs/*.md runs, as a reader pastes it.

One test per block (``test_doc_block[docs/indexing.md:102]``). The blocks of one file run
in order in one working directory and, for Python, in one interpreter (a "kernel"
subprocess: names, imports and files made by one block are there for the next, as for a
reader pasting them into one session). Running a single block runs the blocks before it
first. What each kind of block does:

- ``python``: executed in the doc's kernel; a block of ``>>>`` lines is a doctest whose
  shown results must match.
- ``sh`` / ``bash``: one bash script (``set -e``) in the doc's working directory.
- ``console``: ``$ command`` lines run one by one (stderr merged into stdout); the lines
  shown under a command must be what it prints, after masking what depends on the
  machine or the clock (the working directory, timings and rates, digests, mtimes), and
  a ``...`` line stands for any lines. A command shown with no output must succeed.
- untagged or ``text`` / ``json`` blocks are output, diagrams, synopses: not run, but an
  untagged block that starts like a command fails (tag it ``sh`` or ``console``).

A block that cannot run as pasted here says so in the markdown with a comment right
above it, which every doc test reports: ``<!-- docs-test: skip: why -->`` (pytest
shows the reason in its skip list), or ``<!-- docs-test: torchrun N -->`` (the block runs
as a script under ``torchrun --standalone --nproc_per_node N``, a local rendezvous).

What a reader brings of their own (their bucket, their shard pattern, their model, an
``epochs`` count) is filled in by this module's fixture: each doc's working directory
holds the shards of ``tools/make_shards.py images DIR --samples 300 --shards 6`` under
the names that doc uses, ``s3://bucket/`` is a moto server on loopback, ``https://host/``
a loopback HTTP server. Every such substitution is listed in :data:`PLACEHOLDERS` and
must still match its doc, so the list cannot go stale.

Why a collector of our own rather than pytest-markdown-docs or sybil: both run Python
blocks only (shell and console sessions would need our own runner anyway), neither
compares a console block's shown output, and fixtures that lay out shards, start moto and
run a block under torchrun are plain pytest here; it needs no package beside torch.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dist_helpers import free_port
from doc_blocks import DOCS, ROOT, Block, blocks

pytest_plugins = ["conftest_servers"]

RUN = {"python", "sh", "bash", "shell", "console"}
NOT_RUN = {"", "text", "json"}
COMMAND = re.compile(r"^(\$ |wds-pad |python |torchrun |pip |make |\.venv/)")
SLOW = re.compile(r"torchrun|num_workers=[1-9]|make demo|wds-pad demo|init_process_group|make_shards\.py|examples/")
BLOCK_TIMEOUT = 240.0
BIN = Path(sys.executable).parent

# (doc, text in the doc, what the test runs instead, why). Each must occur in its doc.
PLACEHOLDERS: list[tuple[str, str, str, str]] = [
    ("*", "{000000..000999}", "{000000..000005}", "your shards: the fixture has 6"),
    ("*", "{000000..000099}", "{000000..000005}", "your shards: the fixture has 6"),
    ("*", "{000000..000031}", "{000000..000005}", "your shards: the fixture has 6"),
    ("README.md", "storage_options={...}", "storage_options={}", "your credentials: moto's, from the environment"),
    ("docs/object-storage.md", '"key": "AKIA...", "secret": "..."', '"key": "testing", "secret": "testing"',
     "your credentials: moto's"),
    ("docs/resume.md", '"/ckpt/run1", 100, 10', '"ckpt/run1", 3, 2',
     "your checkpoint folder and run: one in the working directory, a save every 3 steps, 2 epochs"),
    # (before the next one, which changes /tmp/wds-data)
    ("docs/distributed.md", 'torchrun --nproc_per_node 2 examples/train_ddp.py --data /tmp/wds-data --out "$(mktemp -d)"',
     'OUT=$(mktemp -d); torchrun --nproc_per_node 2 examples/train_ddp.py --data /tmp/wds-data --out "$OUT"',
     "the same fresh run folder, named for the wait below"),
    ("docs/distributed.md", "/tmp/wds-data", "wds-data", "your data folder: one in the working directory"),
    ("docs/distributed.md", "--out /tmp/run", "--out run", "your run folder: one in the working directory"),
    ("docs/distributed.md", "sleep 15", 'while kill -0 "$TORCHRUN" && ! { [ -s "$OUT/samples-rank00000.jsonl" ] && '
     '[ -s "$OUT/samples-rank00001.jsonl" ]; }; do sleep 0.1; done',
     "your wait for training to be under way: here until both ranks have logged a step"),
    ("docs/concepts.md", '"cuda", (4, 2)', '"cpu", (1, 2)', "your 8 GPUs: 2 CPU processes here"),
    ("docs/distributed.md", '"cuda", (dp, cp)', '"cpu", (1, 2)', "your GPUs and mesh sizes: 2 CPU processes here"),
]

# Python run in a doc's kernel before its first block: the reader's own objects.
PRELUDE: dict[str, str] = {
    "README.md": "epochs = 1\nurls = sorted(__import__('glob').glob('shards/train-*.tar'))\n",
    "docs/indexing.md": "urls = 'shards/shard-{000000..000005}.tar'\n",
    "docs/planning.md": textwrap.dedent("""\
        from wds_pad import Topology
        web_buckets = {"short": range(0, 40), "long": range(40, 60)}    # your datasets' buckets
        book_buckets = {"short": range(60, 70), "long": range(70, 100)}
        topo, seed, epoch = Topology(world_size=2, rank=0), 7, 0
        """),
    "docs/object-storage.md": "index = 'train.wdsidx'   # your index\n",
    "docs/distributed.md": textwrap.dedent("""\
        import wds_pad
        latest, index = None, "train.wdsidx"     # examples/train_ddp.py's: no checkpoint yet
        loader = wds_pad.Loader(wds_pad.BucketedWebDataset(index, batch_size=4, seed=1234))
        """),
    "docs/streaming.md": "urls = sorted(__import__('glob').glob('shards/shard-*.tar'))   # your shards\n",
    "docs/shards.md": textwrap.dedent("""\
        import os
        epochs, epoch, step, resuming = 1, 0, 0, False   # your loop's counters
        rank = int(os.environ.get("RANK", 0))
        """),
    "docs/resume.md": textwrap.dedent("""\
        import torch, wds_pad
        loader = wds_pad.Loader(wds_pad.BucketedWebDataset("train.wdsidx", batch_size=4, seed=1234))  # your loader
        def preprocess(sample):                     # your model's side of things
            return sample
        _net = torch.nn.Linear(4, 2)
        def build_model():
            return _net
        def build_optimizer():
            return torch.optim.SGD(_net.parameters(), lr=0.1)
        def train_step(model, opt, batch):
            return 0.0
        """),
    "docs/concepts.md": textwrap.dedent("""\
        import torch.distributed as dist
        ids_square, ids_wide = range(0, 100), range(100, 130)   # your sample ids
        epoch = 0
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        g = dist.new_group([0])                                  # your process group
        """),
}

# Where each doc's shards live in its working directory (directory, file-name prefix).
LAYOUT: dict[str, tuple[str, str]] = {
    "README.md": ("shards", "train-"),
    "docs/shards.md": ("data", "train-"),
}
S3_DOCS = {"README.md", "docs/indexing.md", "docs/object-storage.md", "docs/resume.md"}
HTTP_DOCS = {"docs/object-storage.md"}
TORCHRUN_PRELUDE = {"docs/shards.md"}  # docs whose prelude is also the start of a torchrun block
TORCHRUN_ENV = {"docs/resume.md"}  # their kernel is a one-process job, as torchrun would start it


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _applies(doc: str, where: str) -> bool:
    return where in ("*", doc)


def fill(doc: str, text: str, extra: list[tuple[str, str, str, str]] = ()) -> str:  # type: ignore[assignment]
    """``text`` of a block of ``doc`` with every placeholder of the doc filled in."""
    for where, old, new, _ in [*PLACEHOLDERS, *extra]:
        if _applies(doc, where):
            text = text.replace(old, new)
    return text


# --------------------------------------------------------------------------- kernel
KERNEL = r'''
import doctest, io, json, os, sys, traceback
_docs_proto = os.fdopen(os.dup(1), "w")
_docs_log = open(sys.argv[1], "a", buffering=1)
os.dup2(_docs_log.fileno(), 1)
os.dup2(_docs_log.fileno(), 2)
sys.argv = ["-"]
for _docs_line in sys.stdin:
    _docs_req = json.loads(_docs_line)
    _docs_ns = sys.modules["__main__"].__dict__
    try:
        if _docs_req["doctest"]:
            _docs_test = doctest.DocTestParser().get_doctest(
                _docs_req["code"], _docs_ns, _docs_req["name"], _docs_req["name"], 0)
            _docs_out = io.StringIO()
            _docs_run = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            _docs_run.run(_docs_test, out=_docs_out.write, clear_globs=False)
            _docs_res = {"ok": not _docs_run.failures, "error": _docs_out.getvalue()}
        else:
            exec(compile(_docs_req["code"], _docs_req["name"], "exec"), _docs_ns)
            _docs_res = {"ok": True, "error": ""}
    except BaseException:
        _docs_res = {"ok": False, "error": traceback.format_exc()}
    sys.stdout.flush(); sys.stderr.flush()
    _docs_proto.write(json.dumps(_docs_res) + "\n"); _docs_proto.flush()
'''


class Kernel:
    """One Python interpreter for one doc: blocks are exec'd in its ``__main__``."""

    def __init__(self, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-c", KERNEL, str(log)], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True, text=True)

    def run(self, code: str, name: str, *, doctest: bool = False) -> tuple[bool, str]:
        """Run one block; (ok, traceback or doctest report plus what the block printed)."""
        start = self.log.stat().st_size if self.log.exists() else 0
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"code": code, "name": name, "doctest": doctest}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], BLOCK_TIMEOUT)
        line = self.proc.stdout.readline() if ready else ""
        printed = self.log.read_text(errors="replace")[start:] if self.log.exists() else ""
        if not line:
            self.close()
            return False, f"no answer from the kernel in {BLOCK_TIMEOUT:.0f} s (or it died)\n{printed[-4000:]}"
        res = json.loads(line)
        return res["ok"], res["error"][-3000:] + (f"\n--- printed:\n{printed[-3000:]}" if printed.strip() else "")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# --------------------------------------------------------------------------- shell
_MASKS = [
    (re.compile(r"\b\d+(\.\d+)? s\b"), "<secs> s"),
    (re.compile(r"[\d,]+(\.\d+)? (shards|samples)/s"), r"<rate> \2/s"),
    (re.compile(r"[\d,]+(\.\d+)? MB/s"), "<rate> MB/s"),
    (re.compile(r"\b[0-9a-f]{32}\b|\b[0-9a-f]{16}\b"), "<hex>"),
    (re.compile(r"mtime=\d+(\.\d+)?"), "mtime=<stamp>"),
]
_PROGRESS = re.compile(r"^\S+: +\d+%\|")  # tqdm's bar: drawn on a terminal only


def normalise(text: str, workdir: Path) -> list[str]:
    """Output lines with what depends on the machine or the clock masked."""
    lines = []
    for line in text.replace("/tmp/wds-demo", "<dir>").replace(str(workdir), "<dir>").splitlines():
        if _PROGRESS.match(line):
            continue
        for pattern, repl in _MASKS:
            line = pattern.sub(repl, line)
        lines.append(line.rstrip())
    while lines and not lines[-1]:
        lines.pop()
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """``actual`` equals ``expected``, where an expected ``...`` line stands for any lines."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and actual[0] == expected[0] and matches(expected[1:], actual[1:])


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    """(command, shown output lines) of each ``$ `` line of a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and steps[-1][0].endswith("\\"):
            steps[-1] = (steps[-1][0] + "\n" + line, [])
        elif steps:
            steps[-1][1].append(line)
    return steps


# --------------------------------------------------------------------------- sessions
@dataclass
class DocSession:
    """A doc's working directory, environment and kernel; which blocks ran."""

    doc: str
    workdir: Path
    env: dict[str, str]
    extra: list[tuple[str, str, str, str]]
    done: dict[int, tuple[bool, str]] = field(default_factory=dict)
    kernel: Kernel | None = None

    def run_upto(self, position: int) -> tuple[bool, str]:
        """Run the doc's blocks up to ``position`` (index into its runnable blocks), in order."""
        todo = runnable(self.doc)
        for i in range(position + 1):
            if i not in self.done:
                self.done[i] = self._run(todo[i])
        return self.done[position]

    def _run(self, block: Block) -> tuple[bool, str]:
        marker = block.marker or ""
        if marker.startswith("skip"):
            return True, "skipped"
        code = fill(self.doc, block.text, self.extra)
        if marker.startswith("torchrun"):
            nproc = int(marker.split()[1])
            script = self.workdir / f"block_{block.line}.py"
            script.write_text(PRELUDE.get(self.doc, "") * (self.doc in TORCHRUN_PRELUDE) + code)
            return self._shell([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc),
                                script.name])
        if block.lang == "python":
            if self.kernel is None:
                self.kernel = Kernel(self.workdir, self.env, self.workdir.parent / f"{self.workdir.name}.log")
                if self.doc in PRELUDE:
                    ok, err = self.kernel.run(PRELUDE[self.doc], f"<prelude of {self.doc}>")
                    assert ok, err
            doctest = code.lstrip().startswith(">>>")
            return self.kernel.run(code, block.where, doctest=doctest)
        if block.lang == "console":
            for command, shown in console_steps(code):
                ok, out = self._shell(["bash", "-c", command])
                want, got = normalise("\n".join(shown), self.workdir), normalise(out, self.workdir)
                if (not shown and not ok) or (shown and not matches(want, got)):
                    return False, (f"$ {command}\n--- the doc shows:\n" + "\n".join(want)
                                   + "\n--- it prints (masked):\n" + "\n".join(got))
            return True, ""
        return self._shell(["bash", "-e", "-c", code])

    def _shell(self, argv: list[str]) -> tuple[bool, str]:
        proc = subprocess.Popen(argv, cwd=self.workdir, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return False, f"timed out after {BLOCK_TIMEOUT:.0f} s\n{out[-4000:]}"
        return proc.returncode == 0, out

    def close(self) -> None:
        if self.kernel is not None:
            self.kernel.close()


def runnable(doc: str) -> list[Block]:
    return [b for b in blocks(ROOT / doc) if b.lang in RUN]


ALL = [(_rel(d), i, b) for d in DOCS for i, b in enumerate(runnable(_rel(d)))]


def _param(doc: str, i: int, block: Block) -> Any:
    marks = [pytest.mark.slow] if SLOW.search(block.text) or (block.marker or "").startswith("torchrun") else []
    return pytest.param(doc, i, id=block.where, marks=marks)


@pytest.fixture(scope="session")
def demo_shards(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The shards of ``python tools/make_shards.py images DIR --samples 300 --shards 6``,
    written as plain ustar (``--producer tarfile-ustar``): the docs show their sizes and
    byte offsets as they were before webdataset's pax headers became the default."""
    out = tmp_path_factory.mktemp("doc-shards")
    subprocess.run([sys.executable, str(ROOT / "tools/make_shards.py"), "images", str(out),
                    "--samples", "300", "--shards", "6", "--producer", "tarfile-ustar"],
                   check=True, capture_output=True)
    return sorted(out.glob("shard-*.tar"))


@pytest.fixture(scope="session")
def doc_sessions(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 demo_shards: list[Path]) -> Iterator[Callable[[str], DocSession]]:
    """``session(doc)``: the doc's session, made on first use, closed after the tests."""
    made: dict[str, DocSession] = {}
    s3_ready: list[Any] = []

    def session(doc: str) -> DocSession:
        if doc in made:
            return made[doc]
        workdir = tmp_path_factory.mktemp(re.sub(r"\W", "-", doc))
        directory, prefix = LAYOUT.get(doc, ("shards", "shard-"))
        (workdir / directory).mkdir()
        for src in demo_shards:
            shutil.copy2(src, workdir / directory / src.name.replace("shard-", prefix))
        for name in ("tools", "examples"):  # a reader at the repository root
            (workdir / name).symlink_to(ROOT / name)
        from wds_pad import build_index  # every doc may start from an index of its shards

        build_index(sorted(str(p) for p in (workdir / directory).glob("*.tar")), "aspect:width,height",
                    output=str(workdir / "train.wdsidx"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTEST_"))}
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(workdir)
        extra: list[tuple[str, str, str, str]] = []
        if doc in TORCHRUN_ENV:  # a block that calls init_process_group() as under torchrun
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()))
        if doc in S3_DOCS:
            moto = request.getfixturevalue("moto_server")
            if not s3_ready:
                moto.make_bucket("bucket")
                for i, src in enumerate(demo_shards):
                    moto.upload(src, f"s3://bucket/train-{i:06d}.tar")
                # indexing.md's map:s3://bucket/curation.tsv: a curation list of the demo keys
                curation = "".join(f"{i:06d}\t{'hq' if i % 3 else 'lq'}\n" for i in range(300))
                moto.put_bytes("s3://bucket/curation.tsv", curation.encode())
                build_index("s3://bucket/train-{000000..000005}.tar", "aspect:width,height",
                            output="s3://bucket/train.wdsidx", storage_options=moto.storage_options)
                s3_ready.append(moto)
            env.update(moto.env)
            extra.append((doc, "https://minio.internal:9000", moto.url, "your S3 endpoint: moto on loopback"))
        if doc in HTTP_DOCS:
            www = request.getfixturevalue("nginx_server")
            (www.root_dir / "data").mkdir(exist_ok=True)
            for i, src in enumerate(demo_shards):
                shutil.copy2(src, www.root_dir / "data" / f"train-{i:06d}.tar")
            extra.append((doc, "https://host/", f"{www.url}/", "your HTTP server: one on loopback"))
        made[doc] = DocSession(doc, workdir, env, extra)
        return made[doc]

    yield session
    for s in made.values():
        s.close()


@pytest.mark.parametrize(("doc", "position"), [_param(*a) for a in ALL])
def test_doc_block(doc_sessions: Callable[[str], DocSession], doc: str, position: int) -> None:
    block = runnable(doc)[position]
    if (block.marker or "").startswith("skip"):
        pytest.skip(f"{block.where}: docs-test: {block.marker}")
    ok, report = doc_sessions(doc).run_upto(position)
    assert ok, f"{block.where} does not run as pasted:\n{block.text}\n{report}"


# --------------------------------------------------------------------------- the rules
@pytest.mark.parametrize("doc", DOCS, ids=[_rel(d) for d in DOCS])
def test_every_command_block_is_tagged_to_run(doc: Path) -> None:
    for block in blocks(doc):
        assert block.lang in RUN | NOT_RUN, f"{block.where}: unknown block language {block.lang!r}"
        if block.lang == "":
            first = block.text.lstrip().splitlines()[0] if block.text.strip() else ""
            assert not COMMAND.match(first), (
                f"{block.where} starts like a command but is not run: tag it ```sh (a script) or "
                f"```console ($ lines with their output), or ```text for a synopsis")


def test_every_placeholder_is_used() -> None:
    for where, old, _new, why in PLACEHOLDERS:
        docs = [d for d in DOCS if _applies(_rel(d), where)]
        assert any(old in b.text for d in docs for b in blocks(d) if b.lang in RUN), (
            f"placeholder {old!r} ({why}) occurs in no block of {where}: remove it from PLACEHOLDERS")


def test_exceptions_are_few_and_say_why() -> None:
    markers = [(b.where, b.marker) for d in DOCS for b in blocks(d) if b.marker]
    for where, marker in markers:
        assert re.fullmatch(r"skip: .{10,}|torchrun \d+", marker or ""), f"{where}: bad marker {marker!r}"
    skips = [m for m in markers if (m[1] or "").startswith("skip")]
    assert len(skips) <= 6, f"too many doc blocks are not run: {skips}"


def test_console_output_is_compared_with_masks() -> None:
    work = Path("/tmp/w")
    shown = normalise("indexed 6 shards in 0.08 s -> /tmp/wds-demo/t\n106.5 shards/s  5,324 samples/s  13.8 MB/s", work)
    got = normalise("indexed 6 shards in 1.20 s -> /tmp/w/t\n9.1 shards/s  12 samples/s  0.2 MB/s", work)
    assert shown == got
    assert matches(["a", "...", "z"], ["a", "b", "c", "z"]) and not matches(["a", "z"], ["a", "b", "z"])
    assert console_steps("$ a \\\n  b\n$ c\nout\n") == [("a \\\n  b", []), ("c", ["out"])]
