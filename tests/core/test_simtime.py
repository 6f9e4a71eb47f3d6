"""The time model of ``wds-pad simulate`` (core/local/simtime.py), on timelines computed by hand.

Every case uses GETs of 1.5 s: a latency of 0.5 s plus 100 bytes at 100 bytes a second
(a block of 100 bytes, or a single read of 100 bytes), and a step of 1 s.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from wds_pad.core.local.simtime import Held, Link, ProcessReads, start_offsets, timeline

LINK = Link(latency_s=0.5, bandwidth=100.0, step_s=1.0, in_flight=1, start_s=0.0, stall_s=0.0,
            shards_at_once=1, gets_per_shard=2)
NONE = Held(blocks=np.zeros(0, np.int64), nbytes=np.zeros(0, np.int64), epoch=np.zeros(0, np.int64))


def reads(held: list[int], block: list[int] | None = None, per_batch: int = 1, order: list[list[int]] | None = None,
          epoch_starts: list[int] | None = None) -> ProcessReads:
    n = len(held)
    return ProcessReads(batch_ends=np.arange(per_batch, n + 1, per_batch, dtype=np.int64),
                        held=np.asarray(held, np.int64), block=np.asarray(block or [0] * n, np.int64),
                        nbytes=np.full(n, 100, np.int64), epoch_starts=np.asarray(epoch_starts or [0], np.int64),
                        order=[np.asarray(o, np.int64) for o in (order or [[]])])


def test_single_reads_are_sent_in_flight_ahead_and_a_batch_leaves_with_its_last_read() -> None:
    # one read a step, one in flight: read 0 is sent at the start (0.2), arrives at 1.7 and
    # is handed out, which makes batch 0 (the first batch: it does not wait for read 1)
    p = reads([-1, -1, -1])
    t = timeline([(NONE, [p])], 3, replace(LINK, start_s=0.2), block_bytes=100)
    assert t.first_s == pytest.approx(1.7)
    # read 1 is sent when read 0 is handed out (1.7): 3.2, while step 1 asks at 2.7; read 2
    # is sent at 3.2: 4.7, while step 2 asks at 4.2: each waits 0.5 s
    assert t.asked.tolist() == pytest.approx([0.0, 2.7, 4.2])
    assert t.taken.tolist() == pytest.approx([1.7, 3.2, 4.7])
    assert (t.stalls, t.stall_share) == (2, 1.0)
    # a wait of 0.5 s is no stall when a stall is a wait over 0.6 s
    assert timeline([(NONE, [p])], 3, replace(LINK, start_s=0.2, stall_s=0.6), 100).stalls == 0
    # two in flight: reads 0 and 1 are sent at the start (1.7); read 2 when read 0 is handed
    # out (1.7): 3.2, there before step 2 asks (3.7): nothing waits
    t = timeline([(NONE, [p])], 3, replace(LINK, start_s=0.2, in_flight=2), block_bytes=100)
    assert t.taken.tolist() == pytest.approx([1.7, 2.7, 3.7])
    assert t.stalls == 0


def test_batches_made_ahead_start_when_the_previous_one_is_made() -> None:
    # reads 0 and 1 of a held shard of 2 blocks (one round: both at 1.5), read 2 a single one
    held = Held(blocks=np.asarray([2]), nbytes=np.asarray([200]), epoch=np.zeros(1, np.int64))
    p = reads([0, 0, -1], block=[1, 1, 0], order=[[0]])
    # inside next(): read 1 (there at 1.5) is handed out only when step 1 asks (2.5), and
    # read 2 is sent then: 4.0, half a second after step 2 asks (3.5)
    assert timeline([(held, [p])], 3, LINK, 100).taken.tolist() == pytest.approx([1.5, 2.5, 4.0])
    # one batch ahead: batch 1 is made from 1.5 (batch 0 made and taken), read 2 sent then: 3.0
    assert timeline([(held, [p])], 3, replace(LINK, lookahead=1), 100).taken.tolist() == pytest.approx([1.5, 2.5, 3.5])


def test_held_shards_are_fetched_in_each_process_order_and_shared_by_the_node() -> None:
    # row 0: 4 blocks, row 1: 2 blocks; two GETs in flight per shard: rounds of 1.5 s
    held = Held(blocks=np.asarray([4, 2]), nbytes=np.asarray([400, 200]), epoch=np.zeros(2, np.int64))
    a = reads([0, 0], block=[1, 3], order=[[0, 1]])
    b = reads([1, 1], block=[0, 1], order=[[1]])
    # A fetches row 0 from 0 (blocks 0-1 at 1.5, 2-3 at 3.0), B row 1 (1.5); A skips row 1.
    # Both batches 0 are there at 1.5, the job's first batch; A's batch 1 (block 3) at 3.0,
    # half a second after step 1 asks (2.5)
    t = timeline([(held, [a, b])], 2, LINK, 100)
    assert t.first_s == pytest.approx(1.5)
    assert t.taken.tolist() == pytest.approx([1.5, 3.0]) and t.stalls == 1
    # A's order starts with row 1 (B fetches it too: one of them does), row 0 only from 1.5;
    # but A's read of row 0 reaches the copy at 0, finds nothing under way and fetches it
    a2 = reads([0, 0], block=[1, 3], order=[[1, 0]])
    assert timeline([(held, [a2, b])], 2, LINK, 100).taken.tolist() == pytest.approx([1.5, 3.0])
    # one thread serves the copy in order: a read of row 0 after one of row 1 reaches the copy
    # when row 1's block 1 is there (1.5), just when the prefetch takes row 0: block 1 at 3.0
    a3 = reads([1, 0], block=[1, 1], per_batch=2, order=[[1, 0]])
    assert timeline([(held, [a3])], 1, LINK, 100).first_s == pytest.approx(3.0)
    # the folder kept row 0: nothing to fetch, read at once
    kept = Held(blocks=np.asarray([0, 2]), nbytes=np.asarray([400, 200]), epoch=np.zeros(2, np.int64))
    assert timeline([(kept, [a, b])], 2, LINK, 100).taken.tolist() == pytest.approx([1.5, 2.5])


def test_an_epochs_shards_are_fetched_from_the_nodes_first_read_of_it() -> None:
    held = Held(blocks=np.asarray([2, 2]), nbytes=np.asarray([200, 200]), epoch=np.asarray([0, 1]))
    p = reads([0, 1], block=[1, 1], order=[[0], [1]], epoch_starts=[0, 1])
    # epoch 1's read is sent when read 0 is handed out (1.5): row 1 from 1.5, its block 1 at 3.0
    assert timeline([(held, [p])], 2, LINK, 100).taken.tolist() == pytest.approx([1.5, 3.0])
    # two reads in flight: epoch 1's first read is sent at the start, and so its fetch
    t = timeline([(held, [p])], 2, replace(LINK, in_flight=2), 100)
    assert t.taken.tolist() == pytest.approx([1.5, 2.5]) and t.stalls == 0


def test_the_job_takes_a_step_when_its_slowest_process_has_it() -> None:
    fast, slow = reads([-1]), ProcessReads(batch_ends=np.asarray([1]), held=np.asarray([-1]), block=np.zeros(1, np.int64),
                                           nbytes=np.asarray([400]), epoch_starts=np.asarray([0]), order=[np.zeros(0, np.int64)])
    t = timeline([(NONE, [fast]), (NONE, [slow])], 1, LINK, 100)
    assert t.first_s == pytest.approx(0.5 + 4.0)
    assert timeline([(NONE, [])], 0, LINK, 100).first_s == 0.0


def test_a_process_that_starts_late_makes_the_step_after_the_first_wait() -> None:
    # A (single reads, two in flight, batches of 3 and 1): reads 0-1 at 1.5, read 2 (sent when
    # read 0 is handed out) at 3.0: the job's first batch, step 1 asked at 4.0; read 3 (sent
    # when read 1 is) at 3.0. B fetches a shard of 4 blocks (blocks 0-1 at 1.5, 2-3 at 3.0):
    # its batch 0 at 1.5, batch 1 (block 3) at 3.0: no wait
    a = ProcessReads(batch_ends=np.asarray([3, 4]), held=np.full(4, -1), block=np.zeros(4, np.int64),
                     nbytes=np.full(4, 100), epoch_starts=np.asarray([0]), order=[np.zeros(0, np.int64)])
    held = Held(blocks=np.asarray([4]), nbytes=np.asarray([400]), epoch=np.zeros(1, np.int64))
    b = reads([0, 0, 0, 0], block=[0, 0, 0, 3], per_batch=2, order=[[0]])
    job = [(NONE, [a]), (held, [b])]
    link = replace(LINK, in_flight=2)
    t = timeline(job, 2, link, 100)
    assert t.taken.tolist() == pytest.approx([3.0, 4.0]) and t.stalls == 0
    # B starts 1.2 s after A: its batch 0 at 2.7, its block 3 at 4.2, and step 1 waits for
    # it; the first batch is still 3.0 (B waits 1.5 from its own start)
    late = timeline(job, 2, link, 100, offsets=[0.0, 1.2])
    assert late.taken.tolist() == pytest.approx([3.0, 4.2]) and late.stalls == 1
    assert late.first_s == pytest.approx(3.0)
    # the same from the link's skew, spread over the job's processes in order
    assert timeline(job, 2, replace(link, start_skew_s=1.2), 100).taken.tolist() == pytest.approx([3.0, 4.2])
    # A late instead: the step after the first is asked later, and nothing waits
    assert timeline(job, 2, link, 100, offsets=[1.2, 0.0]).stalls == 0
    assert start_offsets(3, 0.2).tolist() == pytest.approx([0.0, 0.1, 0.2])
    assert start_offsets(1, 0.2).tolist() == [0.0]
    with pytest.raises(ValueError, match="one start >= 0 per process"):
        timeline(job, 2, link, 100, offsets=[0.0])
