"""The emulated link (picotron/link.py): results stay exact, a collective takes at least the link's time, messages
queue first in first out, waiting costs no CPU, a recorder times the emulated end, bad parameters are refused."""
import time

import pytest
import torch

from picotron import metrics
from picotron.launch import run_on_ranks
from picotron.link import EmulatedLink
from picotron.mesh import Mesh

BW, LAT = 20e6, 0.05  # 20 MB/s, 50 ms: far slower than the real local transfer of these few bytes


def _on_link(n_elems):
    mesh = Mesh.init(dp=2)
    link = EmulatedLink(BW, LAT)
    tl = metrics.Timeline("cpu", mesh.rank)
    axis = mesh.over(link).recorded(metrics.Recorder(tl)).world
    x = torch.full((n_elems,), float(mesh.rank + 1))
    t0, c0 = time.perf_counter(), time.process_time()
    axis.all_reduce(x)  # synchronous: returns when the link is done
    sync_s, sync_cpu = time.perf_counter() - t0, time.process_time() - c0
    a, b = torch.ones(n_elems), torch.ones(n_elems)
    t1 = time.perf_counter()
    w1 = axis.all_reduce(a, async_op=True)
    w2 = axis.all_reduce(b, async_op=True)  # queued behind w1 on this rank's link
    launch_s = time.perf_counter() - t1
    w1.wait()
    first_s = time.perf_counter() - t1
    w2.wait()
    both_s = time.perf_counter() - t1
    time.sleep(0.05)  # let the futures' callbacks record their ends
    comm = [e for e in tl.events if e.get("kind") == "comm"]
    return dict(sum=x[0].item(), a=a[0].item(), sync_s=sync_s, sync_cpu=sync_cpu, launch_s=launch_s,
                first_s=first_s, both_s=both_s, log=link.log, durations=[e["end"] - e["start"] for e in comm])


def test_collectives_are_exact_and_take_the_links_time():
    n_elems = 250_000  # 1 MB of fp32
    expect = LAT + 2 * (2 - 1) / 2 * 4 * n_elems / BW  # ring all-reduce on 2 ranks: 0.05 + 0.05 = 0.1 s
    for r in run_on_ranks(_on_link, 2, n_elems):
        assert r["sum"] == 3.0 and r["a"] == 2.0  # the real all-reduce ran
        assert expect <= r["sync_s"] < expect + 1.0, r
        assert r["sync_cpu"] < 0.5 * expect, r  # waiting for the link is a sleep, not a busy core
        assert r["launch_s"] < expect, r  # asynchronous launches return at once
        assert r["first_s"] >= expect and r["both_s"] >= 2 * expect, r  # first in, first out on one link
        kinds, wire, starts, ends = zip(*r["log"])
        assert kinds == ("all_reduce",) * 3 and wire[0] == pytest.approx(4 * n_elems)
        assert starts[2] == pytest.approx(ends[1])  # the second async message waited for the first
        assert all(d >= expect - 1e-3 for d in r["durations"]), r["durations"]  # the recorder saw the link's end


def test_link_time_model_and_bad_parameters():
    link = EmulatedLink(100e6, 1e-3)
    assert link.seconds("all_reduce", 100e6, 4) == pytest.approx(1e-3 + 1.5)
    assert link.seconds("all_gather_into_tensor", 100e6, 4) == pytest.approx(1e-3 + 0.75)
    assert link.seconds("broadcast", 1e6, 8) == pytest.approx(1e-3 + 0.01)
    assert "100 MB/s, 1 ms" in link.label()
    for bad in (dict(bandwidth=0), dict(bandwidth=1e6, latency=-1)):
        with pytest.raises(ValueError, match="bandwidth must be > 0"):
            EmulatedLink(**bad)
