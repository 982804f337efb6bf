"""An emulated network link: collectives that take as long as a link of a set bandwidth and latency would.

Why: on a CPU, gloo moves the bytes with the same cores the backward pass computes on, so a lesson that overlaps
communication with computation (DP's buckets, ZeRO-3's prefetch) cannot show a gain: hiding the all-reduce
behind backward just slows backward down. A real interconnect (NVLink, InfiniBand) moves bytes with its own
hardware. `EmulatedLink` stands in for that hardware: every collective still runs for real (so every result
is exact), and then completes no earlier than the time a ring collective would take on a link of
`bandwidth` bytes/s and `latency` s per message:

    T = latency + traffic / bandwidth,   traffic per rank (ring): all-reduce 2(n-1)/n·B,
                                         all-gather and reduce-scatter (n-1)/n·B (B: the whole buffer),
                                         broadcast B; all-to-all: the rows it sends to the others

Messages on one rank share its link: a message starts when the one before it has finished (first in, first
out). The waiting is a sleep (a timer thread completes the work's future): it costs no core, as waiting for a
NIC costs none. Choose a link slow enough that the emulated time dwarfs the real local transfer (which still
happens, and still uses cores); the lessons print both.

    link = EmulatedLink(bandwidth=100e6, latency=1e-3)     # 100 MB/s, 1 ms
    mesh = mesh.over(link)                                   # the same groups, every axis's collectives emulated

This is a model, labelled as such wherever it is plotted; on a GPU with a real interconnect, use no link.

Point-to-point batches (`Axis.exchange`: async TP's ring steps) take the link's time too when the link is made with
`messages=True`: latency + the bytes the batch sends / bandwidth, queued on the same link. Off by default, so the
lessons that emulate only collectives (03, 04) time what they did.
"""
import threading
import time

import torch

from picotron.compat import collective

# bytes each rank sends for a collective over a buffer of B bytes among n ranks, as a multiple of B (ring)
TRAFFIC = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather_into_tensor": lambda n: (n - 1) / n,
           "reduce_scatter_tensor": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
           "send": lambda n: 1.0,  # a point-to-point batch: the bytes it sends
           "all_to_all_single": lambda n: 1.0}  # (given as the bytes this rank sends to the others: splits vary)


class EmulatedLink:
    """A per-process link of `bandwidth` bytes/s and `latency` seconds per message (see the module's text).
    `ops(real)` gives a torch.distributed-like namespace whose collectives run `real`'s and take the link's time;
    `log` lists (kind, bytes on the wire, start, end) of every message, in the process's perf_counter seconds."""

    def __init__(self, bandwidth, latency=0.0, messages=False):
        if not bandwidth > 0 or latency < 0:
            raise ValueError(f"EmulatedLink(bandwidth={bandwidth}, latency={latency}): the bandwidth must be > 0 "
                             f"bytes/s and the latency >= 0 s (e.g. EmulatedLink(100e6, 1e-3): 100 MB/s, 1 ms).")
        self.bandwidth, self.latency = float(bandwidth), float(latency)
        self.messages = messages  # also hold Axis.exchange's point-to-point batches to the link's time
        self.free_at = 0.0  # when the last message queued on this link is done
        self.log = []
        self._lock = threading.Lock()

    def __repr__(self):
        return f"EmulatedLink({self.bandwidth / 1e6:g} MB/s, {self.latency * 1e3:g} ms)"

    def label(self):
        return f"emulated link: {self.bandwidth / 1e6:g} MB/s, {self.latency * 1e3:g} ms latency"

    def seconds(self, kind, nbytes, n):
        """The link's time for one collective over a buffer of `nbytes` among `n` ranks."""
        return self.latency + TRAFFIC[kind](n) * nbytes / self.bandwidth

    def ops(self, real):
        return _LinkOps(self, real)

    def _schedule(self, kind, nbytes, n):
        """Queue one message: (start, end) on this link, from now."""
        with self._lock:
            start = max(time.perf_counter(), self.free_at)
            end = start + self.seconds(kind, nbytes, n)
            self.free_at = end
            self.log.append((kind, TRAFFIC[kind](n) * nbytes, start, end))
        return start, end


class _LinkOps:
    """The collectives the mesh's axes call (torch.distributed's signatures), each held until the link is done."""

    def __init__(self, link, real):
        self.link, self.real = link, real

    def _call(self, kind, tensor_bytes, group, async_op, fn):
        import torch.distributed as dist

        n = dist.get_world_size(group)
        work = fn(True)  # always asynchronous underneath: the link's time runs from the launch
        _, end = self.link._schedule(kind, tensor_bytes, n)
        held = _LinkWork(work, end)
        if async_op:
            return held
        held.wait()
        return None

    def all_reduce(self, t, op=None, group=None, async_op=False):
        kw = {} if op is None else {"op": op}
        return self._call("all_reduce", _nbytes(t), group, async_op,
                          lambda a: self.real.all_reduce(t, group=group, async_op=a, **kw))

    def all_gather_into_tensor(self, out, t, group=None, async_op=False):
        gather = collective(self.real, "all_gather_into_tensor")  # torch's newest spelling (picotron/compat.py)
        return self._call("all_gather_into_tensor", _nbytes(out), group, async_op,
                          lambda a: gather(out, t, group=group, async_op=a))

    def reduce_scatter_tensor(self, out, t, op=None, group=None, async_op=False):
        kw = {} if op is None else {"op": op}
        scatter = collective(self.real, "reduce_scatter_tensor")
        return self._call("reduce_scatter_tensor", _nbytes(t), group, async_op,
                          lambda a: scatter(out, t, group=group, async_op=a, **kw))

    def broadcast(self, t, src, group=None, async_op=False):
        return self._call("broadcast", _nbytes(t), group, async_op,
                          lambda a: self.real.broadcast(t, src, group=group, async_op=a))

    def all_to_all_single(self, out, t, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        """An all-to-all (expert parallelism's dispatch and combine): the link carries the rows this rank sends to
        the others (its own block stays home), as one message."""
        import torch.distributed as dist

        n, me = dist.get_world_size(group), dist.get_rank(group)
        row = _nbytes(t) // t.shape[0] if t.dim() and t.shape[0] else 0
        home = input_split_sizes[me] * row if input_split_sizes else _nbytes(t) // n
        return self._call("all_to_all_single", _nbytes(t) - home, group, async_op,
                          lambda a: self.real.all_to_all_single(out, t, output_split_sizes, input_split_sizes,
                                                                group=group, async_op=a))

    def exchange_batch(self, ops, group=None):
        """A batch of point-to-point messages (picotron.p2p.exchange's ops), done when the real messages have
        arrived and the link has carried the bytes this rank sends (with `messages=True`; else untouched)."""
        from picotron import p2p

        works = p2p.exchange(ops, group)
        if not self.link.messages or not works:
            return works
        _, end = self.link._schedule("send", sum(_nbytes(t) for kind, t, _ in ops if kind == "send"), 2)
        return [_LinkWork(_AllOf(works), end)]


class _AllOf:
    """Several handles as one: waiting waits for each."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait()
        return True


def _nbytes(t):
    return t.numel() * t.element_size()


class _LinkWork:
    """A collective's handle that completes when both the real collective and the emulated link are done.
    Its future is completed by a timer thread at the link's end time (or later, if the real one is slower)."""

    def __init__(self, work, end):
        self.work, self.end = work, end
        self.future = torch.futures.Future()
        self._lock = threading.Lock()  # the real work is waited for once, by whichever thread comes first: a second
        # wait from another thread may write the output again (gloo's reduce-scatter) or hang (point-to-point)
        delay = max(0.0, end - time.perf_counter())
        timer = threading.Timer(delay, self._finish)
        timer.daemon = True
        timer.start()

    def _real_wait(self):
        with self._lock:
            if self.work is not None:
                self.work.wait()
                self.work = None

    def _finish(self):
        self._real_wait()
        self.future.set_result(None)

    def wait(self, timeout=None):
        self._real_wait()
        delay = self.end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return True

    def is_completed(self):
        return self.future.done()

    def get_future(self):
        return self.future
