"""Pipeline schedules as data, checked by the simulator (no processes): every schedule for p = 1..8,
m = 1..16, v = 1..4 runs every F, B (and W) exactly once, each F before its B and B before its W on its rank,
sends matched by receives, no deadlock; bubbles and activations in flight equal the formulas; the simulator
refuses broken schedules with the right sentence; the stage split balances cost."""
import pytest

from picotron import pipeline_schedules as ps
from picotron.model import ModelConfig

RANGE = [(p, m) for p in range(1, 9) for m in range(1, 17)]


@pytest.mark.parametrize("name", ["afab", "1f1b", "zb-h1", "zb-v"])
def test_every_schedule_is_valid_for_every_p_and_m(name):
    for p, m in RANGE:
        sch = ps.build(name, p, m)
        sim = ps.simulate(sch)  # raises ScheduleError on any missing, repeated, misordered action or deadlock
        assert sim.makespan > 0
        kinds = "FBW" if sch.split else "FB"
        assert sum(len(a) for a in sch.ranks) == len(kinds) * m * sch.stages, (name, p, m)
        assert _messages_match(sch), (name, p, m)


def test_interleaved_is_valid_for_every_p_m_v_and_refuses_m_not_a_multiple_of_p():
    for p, m in RANGE:
        for v in range(1, 5):
            if v > 1 and m % p:
                with pytest.raises(ps.ScheduleError, match=f"micro-batches m={m} to be a multiple of pp={p}"):
                    ps.build("interleaved", p, m, v)
                continue
            sch = ps.build("interleaved", p, m, v)
            ps.simulate(sch)
            assert _messages_match(sch), (p, m, v)


def _messages_match(sch):
    """Every send has a matching receive: each stage's F output feeds F of the next stage, each B's input
    gradient feeds B of the previous one, and the rank that sends and the one that receives agree."""
    sent, received = [], []
    for r, acts in enumerate(sch.ranks):
        for a in acts:
            s = sch.stage(r, a.chunk)
            if a.kind == "F" and s < sch.stages - 1:
                sent.append(("act", a.mb, r, sch.where(s + 1, a.mb)[0]))
            if a.kind == "F" and s > 0:
                received.append(("act", a.mb, sch.where(s - 1, a.mb)[0], r))
            if a.kind == "B" and s > 0:
                sent.append(("grad", a.mb, r, sch.where(s - 1, a.mb)[0]))
            if a.kind == "B" and s < sch.stages - 1:
                received.append(("grad", a.mb, sch.where(s + 1, a.mb)[0], r))
    return sorted(sent) == sorted(received)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_bubbles_equal_the_formulas(p, m):
    for name in ("afab", "1f1b"):
        assert ps.simulate(ps.build(name, p, m)).bubble == pytest.approx(ps.bubble_formula(name, p, m))
    for v in (2, 3, 4):
        assert ps.simulate(ps.build("interleaved", p, m, v)).bubble == pytest.approx(
            ps.bubble_formula("interleaved", p, m, v))
    assert ps.simulate(ps.build("zb-h1", p, m)).bubble == pytest.approx(ps.bubble_formula("zb-h1", p, m))
    # the V shape beats ZB-H1, and both beat 1F1B, at the same memory
    zbv = ps.simulate(ps.build("zb-v", p, m))
    assert zbv.bubble < ps.bubble_formula("zb-h1", p, m) < ps.bubble_formula("1f1b", p, m)
    # and it keeps that lead when the input-gradient B costs twice a forward (as on a CPU): the order holds up
    heavy_b = {"F": 1.0, "B": 2.0, "W": 1.0}
    assert ps.simulate(ps.build("zb-v", p, m), heavy_b).bubble < ps.simulate(ps.build("zb-h1", p, m), heavy_b).bubble


def test_dualpipe_is_valid_and_refuses_odd_or_too_few():
    """Every even p to 8 and even m >= 2p to 24: each micro-batch through every stage once, on the chunks of its
    direction (0..m/2-1 from rank 0, the rest from rank p-1), messages matched, no deadlock; p odd, m odd or
    m < 2p refused in one sentence."""
    for p in (2, 4, 6, 8):
        for m in range(2 * p, 25, 2):
            sch = ps.build("dualpipe", p, m)
            ps.simulate(sch)
            ps.simulate(sch, pairs=True)
            assert sum(len(a) for a in sch.ranks) == 3 * m * p and _messages_match(sch), (p, m)
            for r, acts in enumerate(sch.ranks):  # two stages per rank, each micro-batch on its direction's chunk
                assert {sch.stage(r, a.chunk) for a in acts} == {r, p - 1 - r}
                assert all(a.chunk == sch.direction(a.mb) for a in acts)
    for p, m in [(3, 6), (4, 7), (4, 6)]:
        with pytest.raises(ps.ScheduleError, match=f"needs an even pp and an even number of micro-batches m >= 2"):
            ps.build("dualpipe", p, m)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16), (8, 40)])
def test_dualpipe_bubble_is_table_2s(p, m):
    """DeepSeek-V3's Table 2: idle (p/2 - 1)(F&B + B - 3W) per rank, B the whole backward. With t_F = t_B = t_W = 1
    and F&B = F + B + W = 3 (a forward and the other direction's B and W back to back, nothing overlapped, but
    run as one unit: `pairs`, both outputs leave at its end) the simulated step is 3m + (p - 2): the formula's
    p - 2. Run action by action (a CPU: each output leaves at its own end) it idles less, half of that. Its
    activations: p + 1 micro-batches' worth on every rank (Table 2), at twice the parameters."""
    sch = ps.build("dualpipe", p, m)
    paired = ps.simulate(sch, pairs=True)
    assert paired.makespan - 3 * m == pytest.approx(ps.dualpipe_idle(p)) == pytest.approx(p - 2)
    assert paired.bubble == pytest.approx(ps.bubble_formula("dualpipe", p, m))
    alone = ps.simulate(sch)
    assert alone.makespan - 3 * m == pytest.approx((p / 2 - 1) * 1)
    assert alone.peak_alive == paired.peak_alive == [p + 1] * p
    # DualPipe's idle does not grow with m and is below ZB-H1's p - 1 (at the same unit costs)
    assert ps.dualpipe_idle(p) < p - 1 and ps.bubble_formula("dualpipe", p, m) < ps.bubble_formula("zb-h1", p, m)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (8, 16)])
def test_activations_in_flight(p, m):
    """AFAB holds all m micro-batches on every stage, 1F1B p - i on stage i, ZB-H1 at most p, ZB-V at most
    2p half-size chunks (= p whole stages): 1F1B's worst stage."""
    assert ps.simulate(ps.build("afab", p, m)).peak_alive == [m] * p
    assert ps.simulate(ps.build("1f1b", p, m)).peak_alive == [p - i for i in range(p)]
    assert max(ps.simulate(ps.build("zb-h1", p, m)).peak_alive) <= p
    assert max(ps.simulate(ps.build("zb-v", p, m)).peak_alive) <= 2 * p


def test_warmup_counts():
    """1F1B: stage i warms up with p - i - 1 forwards, then the steady state starts with one more forward and
    the first backward; interleaved warms up with 2(p - i - 1) + (v - 1)p."""
    p, m, v = 4, 8, 2
    for name, want in (("1f1b", lambda i: p - i - 1), ("interleaved", lambda i: 2 * (p - i - 1) + (v - 1) * p)):
        sch = ps.build(name, p, m, v)
        for i, acts in enumerate(sch.ranks):
            assert [a.kind for a in acts].index("B") == want(i) + 1, (name, i)


def test_simulator_names_the_first_problem():
    A = ps.Action
    good = ps.one_f_one_b(2, 2)
    with pytest.raises(ps.ScheduleError, match="rank 1 never runs B of micro-batch 1"):
        ps.simulate(ps.Schedule("x", 2, 2, 1, [good.ranks[0], good.ranks[1][:-1]]))
    with pytest.raises(ps.ScheduleError, match=r"rank 0, action 1 \(B0\): B of micro-batch 0 comes before its F"):
        ps.simulate(ps.Schedule("x", 2, 2, 1, [[A("F", 1, 0), A("B", 0, 0), A("F", 0, 0), A("B", 1, 0)],
                                              good.ranks[1]]))
    with pytest.raises(ps.ScheduleError, match="appears twice"):
        ps.simulate(ps.Schedule("x", 2, 2, 1, [good.ranks[0] + [A("F", 0, 0)], good.ranks[1]]))
    # rank 1 wants micro-batch 1's forward first, rank 0 wants 0's backward first: a deadlock
    with pytest.raises(ps.ScheduleError, match=r"deadlock: rank 0 waits at B0 for B0 of stage 1 .*rank 1 waits at F1"):
        ps.simulate(ps.Schedule("x", 2, 2, 1, [[A("F", 0, 0), A("B", 0, 0), A("F", 1, 0), A("B", 1, 0)],
                                              [A("F", 1, 0), A("F", 0, 0), A("B", 0, 0), A("B", 1, 0)]]))
    with pytest.raises(ps.ScheduleError, match="kind 'W' is not one of"):
        ps.simulate(ps.Schedule("x", 1, 1, 1, [[A("F", 0, 0), A("B", 0, 0), A("W", 0, 0)]]))
    # DualPipe: micro-batch 3 enters at rank 1 (its stage 0 is rank 1's chunk 1), not on rank 0's chunk 0
    dual = ps.dualpipe(2, 4)
    wrong = ps.Schedule("x", 2, 4, 2, [[A(a.kind, a.mb, 0 if a.mb == 3 and r == 0 else a.chunk) for a in acts]
                                       for r, acts in enumerate(dual.ranks)], split=True, shape="dual")
    with pytest.raises(ps.ScheduleError,
                       match=r"rank 0, action 5 \(F3\): micro-batch 3 goes through stage 0 on rank 1, chunk 1"):
        ps.simulate(wrong)


def test_one_stage_is_gradient_accumulation():
    """With p = 1 every schedule is m forwards and backwards in a row: nothing idles."""
    for name in ("afab", "1f1b", "zb-h1"):
        sim = ps.simulate(ps.build(name, 1, 5))
        assert sim.bubble == 0


def test_stage_split_balances_cost_and_counts_the_head():
    mc = ModelConfig.from_preset("tiny")
    assert ps.split_layers(mc, 2, 128) == [(0, 2), (2, 4)]
    assert ps.split_layers(mc, 4, 128) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # a big vocabulary makes the LM head worth layers: the last stage gets fewer of them
    big = ModelConfig.from_preset("tiny", vocab_size=32768, num_hidden_layers=8)
    cuts = ps.split_layers(big, 2, 128)
    assert cuts[0][1] - cuts[0][0] > cuts[1][1] - cuts[1][0]
    costs = ps.layer_costs(big, 128)
    per_stage = [sum(costs[1 + lo:1 + hi]) + (costs[-1] if s == 1 else 0) for s, (lo, hi) in enumerate(cuts)]
    best = min(max(sum(costs[1:1 + k]), sum(costs[1 + k:-1]) + costs[-1]) for k in range(1, 8))
    assert max(per_stage) == best
    with pytest.raises(ValueError, match="need at least 5 layers"):
        ps.split_layers(mc, 5, 128)


def test_the_schedules_need_no_torch():
    """The schedules, the simulator and the stage split are pure Python: the planner uses them without torch."""
    import subprocess
    import sys
    code = ("import sys, picotron.pipeline_schedules\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _as_traces(steps):
    """with_messages' lists as the traces picotron.nccl_rules replays: each message one batch on the group of its
    two ranks, a receive waited for just before the action that needs it, the sends at the end of the step."""
    from picotron.pipeline_schedules import Message
    traces = []
    for r, items in enumerate(steps):
        events, recvs, sends = [], {}, []
        for h, it in enumerate(items, 1):
            if isinstance(it, Message):
                lo, hi = sorted((r, it.peer))
                events.append(dict(op="i" + it.op, comm=f"{lo}-{hi}", peer=it.peer, bytes=4, batch=h, handle=h,
                                   where=repr(it)))
                if it.op == "recv":
                    recvs[it.kind, it.mb, it.chunk] = h
                else:
                    sends.append(h)
            elif (it.kind, it.mb, it.chunk) in recvs:
                events.append(dict(op="wait", handle=recvs.pop((it.kind, it.mb, it.chunk))))
        events += [dict(op="wait", handle=h) for h in sends]
        assert not recvs, (r, recvs)  # every receive is used by an action
        groups = {f"{a}-{b}": [a, b] for a in range(len(steps)) for b in range(a + 1, len(steps))}
        traces.append(dict(rank=r, groups=groups, events=events))
    return traces


CASES = [(n, p, m, 1) for n in ("afab", "1f1b", "zb-h1", "zb-v") for p in range(1, 9) for m in (1, 2, 3, 5, 8, 16)] + \
        [("interleaved", p, m, v) for p in range(2, 6) for v in (2, 3) for m in (p, 2 * p, 3 * p)] + \
        [("dualpipe", p, m, 2) for p in (2, 4, 6) for m in (2 * p, 2 * p + 2, 4 * p)]


def test_messages_in_one_order_meet_under_nccls_rules():
    """Every schedule's messages, placed by with_messages, replay clean under NCCL's rule for several communicators
    (one queue per rank); each rank's actions keep their order, each receive comes before the action that uses it
    and each send right after the action that made it."""
    from picotron import nccl_rules
    from picotron.pipeline_schedules import Message
    for name, p, m, v in CASES:
        sch = ps.build(name, p, m, v)
        steps = ps.with_messages(sch)
        for r, items in enumerate(steps):
            assert [a for a in items if not isinstance(a, Message)] == sch.ranks[r], (name, p, m, r)
            for k, it in enumerate(items):
                if isinstance(it, Message) and it.op == "send":
                    made = [a for a in items[:k] if not isinstance(a, Message)][-1]
                    assert (made.kind, made.mb, made.chunk) == (it.kind, it.mb, it.chunk), (name, p, m, r, k)
        verdict = nccl_rules.replay(_as_traces(steps))
        assert verdict.ok, (name, p, m, v, verdict)


def test_receives_posted_one_action_ahead_break_the_one_order():
    """The executor's order before with_messages (each action's receive posted one action ahead, on a group per
    direction) replays clean per communicator and deadlocks under one order: the check above can fail."""
    from picotron import nccl_rules
    from picotron.pipeline_schedules import Message
    sch = ps.build("1f1b", 2, 2)
    steps = []
    for r, acts in enumerate(sch.ranks):
        items, posted = [], set()
        for k, a in enumerate(acts):
            for b in acts[k:k + 2]:
                peer = 1 - r
                if ((b.kind == "F" and r == 1) or (b.kind == "B" and r == 0)) and b not in posted:
                    posted.add(b)
                    items.append(Message("recv", b.kind, b.mb, b.chunk, peer))
            items.append(a)
            if (a.kind == "F" and r == 0) or (a.kind == "B" and r == 1):
                items.append(Message("send", a.kind, a.mb, a.chunk, 1 - r))
        steps.append(items)
    traces = _as_traces(steps)
    for t in traces:  # a group per direction, as mesh.pp_links was
        for e in t["events"]:
            if "comm" in e:
                e["comm"] = "F" if (e["op"] == "isend") == (t["rank"] == 0) else "B"
        t["groups"] = {"F": [0, 1], "B": [0, 1]}
    assert nccl_rules.replay(traces, order="per-communicator").ok
    assert "several communicators" in str(nccl_rules.replay(traces))
