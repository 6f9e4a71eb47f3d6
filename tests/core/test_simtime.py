"""The time model of ``wds-pad simulate`` (core/simtime.py), on timelines computed by hand.

Every case uses GETs of 1.5 s: a latency of 0.5 s plus 100 bytes at 100 bytes a second
(a block of 100 bytes, or a single read of 100 bytes), and a step of 1 s.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from wds_pad.core.simtime import Held, Link, ProcessReads, timeline

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


def test_single_reads_are_sent_in_flight_ahead_only_while_the_stream_runs() -> None:
    # one read a step, one in flight: a read is sent when the previous batch's last read is
    # handed out, i.e. when its step asks (0.2 s after the stream's start for the first)
    p = reads([-1, -1, -1])
    t = timeline([(NONE, [p])], 3, replace(LINK, start_s=0.2), block_bytes=100)
    assert t.first_s == pytest.approx(0.2 + 1.5)
    assert t.asked.tolist() == pytest.approx([0.0, 2.7, 5.2])
    assert t.taken.tolist() == pytest.approx([1.7, 4.2, 6.7])
    assert (t.stalls, t.stall_share) == (2, 1.0)
    # two in flight: read 1 is sent at the start with read 0 (ready at 1.7, before step 1 asks
    # at 2.7); read 2 when read 0 is handed out (2.7): 4.2, asked at 3.7: waits 0.5 s
    t = timeline([(NONE, [p])], 3, replace(LINK, start_s=0.2, in_flight=2), block_bytes=100)
    assert t.taken.tolist() == pytest.approx([1.7, 2.7, 4.2])
    assert t.stalls == 1
    # a wait of 0.5 s is no stall when a stall is a wait over 0.6 s
    assert timeline([(NONE, [p])], 3, replace(LINK, start_s=0.2, in_flight=2, stall_s=0.6), 100).stalls == 0


def test_batches_made_ahead_start_when_the_previous_one_is_made() -> None:
    p = reads([-1, -1])
    # inside next(): read 1 is sent when step 1 asks (2.5), arrives at 4.0
    assert timeline([(NONE, [p])], 2, LINK, 100).taken.tolist() == pytest.approx([1.5, 4.0])
    # one batch ahead: batch 1 is made from 1.5 (batch 0 made and taken), arrives at 3.0
    assert timeline([(NONE, [p])], 2, replace(LINK, lookahead=1), 100).taken.tolist() == pytest.approx([1.5, 3.0])


def test_held_shards_are_fetched_in_each_process_order_and_shared_by_the_node() -> None:
    # row 0: 4 blocks, row 1: 2 blocks; two GETs in flight per shard: rounds of 1.5 s
    held = Held(blocks=np.asarray([4, 2]), nbytes=np.asarray([400, 200]), epoch=np.zeros(2, np.int64))
    a = reads([0, 0], block=[1, 3], order=[[0, 1]])
    b = reads([1, 1], block=[0, 1], order=[[1]])
    # A fetches row 0 from 0 (blocks 0-1 at 1.5, 2-3 at 3.0), B row 1 from 0 (1.5); A skips row 1
    t = timeline([(held, [a, b])], 2, LINK, 100)
    assert t.first_s == pytest.approx(1.5)
    assert t.taken.tolist() == pytest.approx([1.5, 3.0])  # step 1 asked at 2.5 waits for A's block 3
    assert t.stalls == 1
    # B's order first takes row 1 alone: A's first shard is row 1 too, so A fetches it, then
    # row 0 from 1.5; but A's read of row 0 is sent at 0 and starts its own fetch: block 1 at 1.5
    a2 = reads([0, 0], block=[1, 3], order=[[1, 0]])
    t = timeline([(held, [a2, b])], 2, LINK, 100)
    assert t.taken.tolist() == pytest.approx([1.5, 3.0])
    # the folder kept row 0: nothing to fetch, read at once
    kept = Held(blocks=np.asarray([0, 2]), nbytes=np.asarray([400, 200]), epoch=np.zeros(2, np.int64))
    assert timeline([(kept, [a, b])], 2, LINK, 100).taken.tolist() == pytest.approx([1.5, 2.5])


def test_an_epochs_shards_are_fetched_from_the_nodes_first_read_of_it() -> None:
    held = Held(blocks=np.asarray([2, 2]), nbytes=np.asarray([200, 200]), epoch=np.asarray([0, 1]))
    p = reads([0, 1], block=[1, 1], order=[[0], [1]], epoch_starts=[0, 1])
    # epoch 1's read is sent when step 1 asks (2.5): row 1 from 2.5, its block 1 at 4.0
    assert timeline([(held, [p])], 2, LINK, 100).taken.tolist() == pytest.approx([1.5, 4.0])
    # two reads in flight: epoch 1's first read is sent at the start, and so its fetch
    t = timeline([(held, [p])], 2, replace(LINK, in_flight=2), 100)
    assert t.taken.tolist() == pytest.approx([1.5, 2.5]) and t.stalls == 0


def test_the_job_takes_a_step_when_its_slowest_process_has_it() -> None:
    fast, slow = reads([-1]), ProcessReads(batch_ends=np.asarray([1]), held=np.asarray([-1]), block=np.zeros(1, np.int64),
                                           nbytes=np.asarray([400]), epoch_starts=np.asarray([0]), order=[np.zeros(0, np.int64)])
    t = timeline([(NONE, [fast]), (NONE, [slow])], 1, LINK, 100)
    assert t.first_s == pytest.approx(0.5 + 4.0)
    assert timeline([(NONE, [])], 0, LINK, 100).first_s == 0.0
