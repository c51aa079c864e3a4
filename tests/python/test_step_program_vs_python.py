"""The C++ step program against the Python derivations it replaces (kept here only until this
test has shown them equal; then the Python path is deleted): the ring schedule (runtime/layout.py
_ring_plan), the dense grouping (runtime/coalesced.py SegmentTable.build) and the text route
(data/loader.py text_route), on every rank of hand-made and random plans."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest

from zellige import Strategy, _core, make_placement, sequence_from_tokens


# ---- the former Python path, verbatim in logic ----
def old_groups(q_row_offset, k_row_offset, q_len, k_len, num_heads):
    by_shape = defaultdict(list)
    for qo, ko, lq, lk, n in zip(q_row_offset, k_row_offset, q_len, k_len, num_heads, strict=True):
        if lq > 0 and lk > 0 and n > 0:
            by_shape[(lq, lk, n)].append((qo, ko))
    out = []
    for (lq, lk, n), members in sorted(by_shape.items(), reverse=True):
        members.sort()
        out.append((lq, lk, n, [m[0] for m in members], [m[1] for m in members]))
    return out


def old_ring_plan(layout):
    seg_rows, seg_tokens = layout.segment_row_offset, layout.segment_num_tokens
    seg_heads, seg_exchange = layout.segment_num_heads, layout.segment_in_exchange
    seg_sequence = layout.segment_sequence_index
    entries, own_parts, exchange_parts, compact = [], [], [], 0
    for is_exchange in (0, 1):
        for e, g in enumerate(layout.ring_segment.tolist()):
            if seg_exchange[g] != is_exchange:
                continue
            rows = int(seg_tokens[g] * seg_heads[g])
            (exchange_parts if is_exchange else own_parts).append(
                np.arange(seg_rows[g], seg_rows[g] + rows)
            )
            entries.append((e, g, compact, rows))
            compact += rows
    own = np.concatenate(own_parts).tolist() if own_parts else []
    exchange = np.concatenate(exchange_parts).tolist() if exchange_parts else []
    offsets = [c for _, _, c, _ in entries]
    tokens = [int(seg_tokens[g]) for _, g, _, _ in entries]
    heads = [int(seg_heads[g]) for _, g, _, _ in entries]
    step0 = old_groups(offsets, offsets, tokens, tokens, heads)
    degree, position = layout.ring_degree, layout.ring_position
    peer_offset, peers, block_tokens = (
        layout.ring_peer_offset,
        layout.ring_peers,
        layout.ring_block_tokens,
    )
    steps = []
    for s in range(1, int(degree.max()) if degree.size else 1):
        send_to, recv_from = {}, {}
        for e, g, c, rows in entries:
            r = int(degree[e])
            if r <= s or rows == 0:
                continue
            j, base = int(position[e]), int(peer_offset[e])
            sequence = int(seg_sequence[g])
            dst, src = (j + s) % r, (j - s) % r
            if block_tokens[base + dst] > 0:
                send_to.setdefault(int(peers[base + dst]), []).append((sequence, c, rows))
            if block_tokens[base + src] > 0:
                recv_from.setdefault(int(peers[base + src]), []).append(
                    (sequence, g, c, int(block_tokens[base + src]))
                )
        sends = [
            (peer, [(c, c + rows) for _, c, rows in sorted(items)])
            for peer, items in sorted(send_to.items())
        ]
        recvs, q_off, k_off, q_tok, k_tok, q_heads, total = [], [], [], [], [], [], 0
        for peer, items in sorted(recv_from.items()):
            start = total
            for _, g, c, block in sorted(items):
                q_off.append(c)
                k_off.append(total)
                q_tok.append(int(seg_tokens[g]))
                k_tok.append(block)
                q_heads.append(int(seg_heads[g]))
                total += block * int(seg_heads[g])
            recvs.append((peer, [(start, total)]))
        steps.append((sends, recvs, total, old_groups(q_off, k_off, q_tok, k_tok, q_heads)))
    return compact, own, exchange, step0, steps


def old_text_route(batch, plan, rank):
    ranks_of = {p.sequence_id: set(p.ranks) for p in plan.placements}
    sequences = batch.sequences
    source_offset, offset = {}, 0
    for index, sequence in enumerate(sequences):
        if sequence.source_rank == rank:
            source_offset[index] = offset
            offset += sequence.text_tokens
    send_index, send_splits = [], []
    for dest in range(plan.num_ranks):
        rows = 0
        for index, start in source_offset.items():
            if dest in ranks_of[sequences[index].id]:
                send_index += list(range(start, start + sequences[index].text_tokens))
                rows += sequences[index].text_tokens
        send_splits.append(rows)
    recv_splits = []
    for source in range(plan.num_ranks):
        recv_splits.append(
            sum(
                s.text_tokens
                for s in sequences
                if s.source_rank == source and rank in ranks_of[s.id]
            )
        )
    return send_index, send_splits, recv_splits


# ---- comparison ----
def _new_groups(groups):
    return [
        (g.q_len, g.k_len, g.num_heads, g.q_row_offset.tolist(), g.k_row_offset.tolist())
        for g in groups
    ]


def _plans():
    """Hand-made plans (every strategy, uneven heads, overlapping rank sets) and random ones.
    Lengths are at least the largest degree, so no chunk is empty: the former text route sent
    text to ranks holding an empty chunk, the program does not (that is the one intended
    difference)."""
    cases = []
    for world in (2, 3, 4, 5):
        batch = _core.Batch()
        batch.sequences = [
            sequence_from_tokens(10 + i, "video", n, t, src % world)
            for i, (n, t, src) in enumerate(
                [(17, 5, 0), (9, 3, 1), (23, 0, 2), (8, 7, 3), (6, 2, 1)]
            )
        ]
        ranks = list(range(world))
        placements = [
            make_placement(10, Strategy.ring, ranks[::-1]),
            make_placement(11, Strategy.ulysses, ranks[: min(world, 3)]),
            make_placement(12, Strategy.ring, ranks),
            make_placement(13, Strategy.local, [world - 1]),
            make_placement(14, Strategy.ulysses, ranks[::-1][:2]),
        ]
        if world >= 4:
            placements[2] = make_placement(12, Strategy.hybrid, ranks[:4], 2)
        plan = _core.Plan()
        plan.num_ranks, plan.placements = world, placements
        cases.append((f"hand-{world}", batch, plan, 5))
    rng = random.Random(3)
    for trial in range(30):
        world, heads = rng.randint(2, 6), rng.randint(2, 6)
        batch = _core.Batch()
        batch.sequences = [
            sequence_from_tokens(
                i, "video", rng.randint(world, 40), rng.randint(0, 9), rng.randrange(world)
            )
            for i in range(rng.randint(1, 6))
        ]
        placements = []
        for s in batch.sequences:
            ranks = rng.sample(range(world), world)
            kind = rng.choice(["local", "ulysses", "ring", "hybrid"])
            if kind == "ulysses":
                placements.append(
                    make_placement(
                        s.id, Strategy.ulysses, ranks[: rng.randint(2, min(world, heads))]
                    )
                )
            elif kind == "ring":
                placements.append(
                    make_placement(s.id, Strategy.ring, ranks[: rng.randint(2, world)])
                )
            elif kind == "hybrid" and world >= 4:
                placements.append(make_placement(s.id, Strategy.hybrid, ranks[:4], 2))
            else:
                placements.append(make_placement(s.id, Strategy.local, ranks[:1]))
        plan = _core.Plan()
        plan.num_ranks, plan.placements = world, placements
        cases.append((f"random-{trial}", batch, plan, heads))
    return cases


@pytest.mark.parametrize(
    "name,batch,plan,heads", _plans(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_program_equals_former_python_path(name, batch, plan, heads) -> None:
    for rank in range(plan.num_ranks):
        program = _core.compile_step_program(batch, plan, rank, heads, False)
        compact, own, exchange, step0, steps = old_ring_plan(program)
        assert program.ring_num_rows == compact
        assert program.ring_own_rows.tolist() == own
        assert program.ring_exchange_rows.tolist() == exchange
        assert _new_groups(program.ring_step0_groups) == step0
        assert len(program.ring_steps) == len(steps)
        for new, (sends, recvs, total, groups) in zip(program.ring_steps, steps, strict=True):
            assert [(p, list(r)) for p, r in new.sends] == sends
            assert [(p, list(r)) for p, r in new.recvs] == recvs
            assert new.num_recv_rows == total
            assert _new_groups(new.groups) == groups
        for kind, groups in (("local", program.local_groups), ("ulysses", program.exchange_groups)):
            mask = program.segment_kind == getattr(_core.SegmentKind, kind).value
            rows = program.segment_row_offset[mask].tolist()
            tokens = program.segment_num_tokens[mask].tolist()
            assert _new_groups(groups) == old_groups(
                rows, rows, tokens, tokens, program.segment_num_heads[mask].tolist()
            )
        send_index, send_splits, recv_splits = old_text_route(batch, plan, rank)
        route = program.cross_text_route
        assert route.send_index.tolist() == send_index
        assert route.send_splits.tolist() == send_splits
        assert route.recv_splits.tolist() == recv_splits
