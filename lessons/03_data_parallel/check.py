"""Checker for lesson 03's exercises: runs your data-parallel classes on 2 and 3 real processes (gloo, through
picotron.launch.run_on_ranks), each rank with its own batch, and compares every rank's gradients with the mean
of all ranks' gradients computed in one process. It names the rank and the parameter that are wrong and what
the error looks like (off by the world size, still the rank's own gradient, ...), the ranks that hang and the
line of your file where they wait, and whether your all-reduces really overlap the backward pass.

    ./run.sh python lessons/03_data_parallel/check.py [name ...] [--solutions | --module my.py] [--timeout S]
(what each option does, and the call from the notebook: lessons/_checker.py; here --timeout defaults to 10 s.)

The exercises: average_gradient (NaiveDP), on_gradient_ready (BucketedDP.on_gradient_ready and
finish_sync), no_sync (BucketedDP.no_sync; checked with the reference's hook, so it does not depend
on exercise 2), bucket_size (the puzzle: exposed_time and best_bucket_mb, checked against the lesson's overlap
model, experiment.model_timeline, on a few links, then on a real training step over an emulated link).

How it works: run_on_ranks pickles the function it runs by reference, so the children run `_on_rank` (below,
at module level). It wraps dist.all_reduce to log every call (size, async_op, how many gradients were ready
at that moment, whether and when its work handle was waited on), imports YOUR file by path, runs a small
Llama (2 layers, hidden 32) on this rank's batches, recomputes the expected mean gradient in one process from
every rank's batches, and meets the other ranks at a store-based rendezvous before returning, so a rank stuck
in a collective shows up as a hang rather than as a peer that left.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import _Failure, attempt, entry_points, load, on_ranks, rendezvous, where  # noqa: E402

import torch  # noqa: E402

from picotron.launch import run_on_ranks  # noqa: E402


LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
WORLD_SIZES = (2, 3)
TIMEOUT_S = 10.0
BUCKET_NUMEL = 4096  # the checker's model has ~35k parameters in 21 tensors: several buckets
EXERCISES = {"average_gradient": "NaiveDP.average_gradient",
             "on_gradient_ready": "BucketedDP.on_gradient_ready + finish_sync",
             "no_sync": "BucketedDP.no_sync",
             "bucket_size": "exposed_time + best_bucket_mb"}
CANDIDATES_MB = (0, 0.0625, 0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)
REAL_RUN_TIMEOUT_S = 300.0  # the puzzle's real run trains for a few steps: minutes on a busy 2-core machine


# --------------------------------------------------------------------------------------- in each child
def _model():
    from picotron.model import Llama, ModelConfig

    cfg = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)  # (init_weights overwrites every parameter: the values depend only on the seed and names)
    return Llama(cfg).init_weights(0)  # built on the CPU directly: the first build on "meta" costs ~1.5 s of imports


def _batch(rank, step, micro):
    """Rank `rank`'s micro-batch `micro` of step `step`: different on every rank."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)


def _loss(model, x, y, k):
    import torch.nn.functional as F

    return F.cross_entropy(model(x).view(-1, 256), y.reshape(-1)) / k


def _expected(n, step, k, rank):
    """(mean over ranks of each rank's gradient, this rank's own gradient), by parameter name, in one process."""
    model = _model()
    mean = {}
    for r in range(n):
        model.zero_grad(set_to_none=True)
        for m in range(k):
            _loss(model, *_batch(r, step, m), k).backward()
        for name, p in model.named_parameters():
            mean[name] = mean.get(name, 0) + p.grad / n
        if r == rank:
            own = {name: p.grad.clone() for name, p in model.named_parameters()}
    return mean, own


class _Work:
    """Wraps an all-reduce's work handle to log when it is waited on."""

    def __init__(self, work, entry, ready):
        self._work, self._entry, self._ready = work, entry, ready

    def wait(self, *args, **kwargs):
        self._entry["waited_at"] = self._ready[0]
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _on_rank(path, name, ref_path):
    """Runs on every rank: the scenario of exercise `name` with the classes of the file at `path`; returns
    [{step, got, expected, own, log, ...}] (one entry per checked backward pass), or raises _Failure."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    ready, log = [0], []  # gradients accumulated so far in this backward; one entry per all_reduce call
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        entry = dict(numel=tensor.numel(), async_op=bool(async_op), at=ready[0], waited_at=None)
        log.append(entry)
        work = real(tensor, *args, **kwargs)
        return _Work(work, entry, ready) if async_op else work

    dist.all_reduce = all_reduce
    try:
        mod = load(path, "ex03")
    except Exception as e:  # noqa: BLE001
        raise _Failure(f"cannot import {Path(path).name}: {type(e).__name__}: {e}{where(e, path)}") from None
    try:
        results = SCENARIOS[name](mod, load(ref_path, "ex03"), rank, n, ready, log)
    except _Failure:
        raise
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
        raise _Failure(f"{type(e).__name__}: {e}{where(e, path)}") from None
    rendezvous(n, "check03/done")
    return results


def _count_ready(model, ready):
    """A hook on every parameter, registered BEFORE the learner's: counts the gradients accumulated so far."""
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: ready.__setitem__(0, ready[0] + 1))


def _grads(model):
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def _scenario_average_gradient(mod, ref, rank, n, ready, log):
    raw = _model()
    model = mod.NaiveDP(raw)
    x, y = _batch(rank, 1, 0)
    _loss(model, x, y, 1).backward()
    mean, own = _expected(n, 1, 1, rank)
    return [dict(step=1, got=_grads(raw), expected=mean, own=own, log=list(log))]


def _scenario_on_gradient_ready(mod, ref, rank, n, ready, log):
    raw = _model()
    _count_ready(raw, ready)
    model = mod.BucketedDP(raw, bucket_numel=BUCKET_NUMEL)
    sizes = [len(b.params) for b in model.buckets]
    out = []
    for step in (1, 2):  # a second step: the bucket counters must start again from zero
        ready[0], first = 0, len(log)
        model.zero_grad()
        _loss(model, *_batch(rank, step, 0), 1).backward()
        after_backward = [e["waited_at"] is not None for e in log[first:]]
        model.finish_sync()
        unwaited = [i for i, e in enumerate(log[first:]) if e["async_op"] and e["waited_at"] is None]
        mean, own = _expected(n, step, 1, rank)
        out.append(dict(step=step, got=_grads(raw), expected=mean, own=own, log=log[first:], bucket_sizes=sizes,
                        total=ready[0], unwaited=unwaited, waited_in_backward=any(after_backward)))
    return out


def _scenario_no_sync(mod, ref, rank, n, ready, log):
    # the learner's no_sync with the reference's hook and wait, so exercise 2 need not be done first
    cls = type("Checked", (mod.BucketedDP,), {"on_gradient_ready": ref.BucketedDP.on_gradient_ready,
                                              "finish_sync": ref.BucketedDP.finish_sync})
    raw = _model()
    model = cls(raw, bucket_numel=BUCKET_NUMEL)
    k, out = 3, []
    # 1. accumulation over k micro-batches, the first k - 1 inside no_sync (as the trainer does)
    sent_inside = []
    for m in range(k):
        first = len(log)
        if m < k - 1:
            with model.no_sync():
                _loss(model, *_batch(rank, 1, m), k).backward()
            sent_inside.append(len(log) - first)
        else:
            _loss(model, *_batch(rank, 1, m), k).backward()
    model.finish_sync()
    mean, own = _expected(n, 1, k, rank)
    out.append(dict(step=1, got=_grads(raw), expected=mean, own=own, sent_inside=sent_inside,
                    sent_last=len(log) - first, sync_after=model.sync))
    # 2. an exception inside the block must not leave synchronisation off
    try:
        with model.no_sync():
            raise KeyError("raised inside no_sync on purpose")
    except KeyError:
        pass
    except Exception as e:  # noqa: BLE001
        raise _Failure(f"an exception raised inside `with model.no_sync():` came out as {type(e).__name__}: {e}")
    out.append(dict(sync_after_exception=model.sync))
    model.sync = True
    # 3. nested blocks: leaving the inner one must not switch synchronisation back on inside the outer one
    model.zero_grad()
    with model.no_sync():
        with model.no_sync():
            pass
        inner_exit = model.sync
        first = len(log)
        _loss(model, *_batch(rank, 2, 0), 1).backward()
        sent_nested = len(log) - first
    model.finish_sync()
    out.append(dict(sync_after_inner_exit=inner_exit, sent_nested=sent_nested, sync_after_outer=model.sync))
    return out


def _lesson():
    """This folder's experiment.py (the overlap model, the emulated-link run), imported by path."""
    import _common

    return _common.load_lesson("03_data_parallel")


def _scenario_bucket_size(mod, ref, rank, n, ready, log):
    """Section 4's emulated run in miniature: measure backward here, size the link from it (choose_link), ask YOUR
    best_bucket_mb for a bucket size, then train a few interleaved steps with it and with one bucket for
    everything, both over that emulated link; return what each left to wait for after backward."""
    from picotron.mesh import Mesh

    lesson = _lesson()
    mesh = Mesh.init(dp=n)
    st = dict(lesson.settings(False, mesh), **lesson.EMULATED, steps=4, warmup=1)
    cfg = lesson.make_cfg(st["size"], seq_len=st["seq_len"], micro_batch_size=st["micro_batch_size"], dp=n)
    backward = lesson.measure_backward(mesh, cfg)
    grad_bytes = lesson.grad_tensor_bytes(cfg.model_config())
    link = lesson.choose_link(sum(grad_bytes), backward, n)
    choice = mod.best_bucket_mb(grad_bytes, backward, *link, n, CANDIDATES_MB)
    rows = lesson.timed(mesh, st, [dict(name="yours", impl="bucket", bucket_mb=choice, link=link),
                                   dict(name="one bucket", impl="bucket", bucket_mb=max(CANDIDATES_MB), link=link)],
                        show=False)
    return dict(choice=choice, backward=backward, link=link, grad_bytes=grad_bytes,
                rows={r["name"]: dict(wait=r["phases"]["link_wait"], n_buckets=r["n_buckets"]) for r in rows})


SCENARIOS = {"average_gradient": _scenario_average_gradient, "on_gradient_ready": _scenario_on_gradient_ready,
             "no_sync": _scenario_no_sync, "bucket_size": _scenario_bucket_size}


# ------------------------------------------------------------------------------------------ the parent
def _close(a, b):
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def gradient_problem(rank, n, res, hint_step2=""):
    """'wrong gradient on rank r for parameter X: ... — likely cause', or None if every gradient matches."""
    got, mean, own = res["got"], res["expected"], res["own"]
    for name, expected in mean.items():
        g = got[name]
        if g is None:
            return f"rank {rank}: parameter {name} has no gradient (p.grad is None); did backward reach it?"
        if g.shape != expected.shape:
            return f"rank {rank}: the gradient of {name} has shape {list(g.shape)}, expected {list(expected.shape)}"
        if torch.allclose(g, expected, rtol=1e-5, atol=1e-7):
            continue
        err = (g - expected).abs().max().item()
        head = (f"wrong gradient on rank {rank} for parameter {name}: max |got - expected| = {err:.1e} "
                f"(largest |expected| {expected.abs().max().item():.1e})")
        if _close(g, n * expected):
            why = (f"off by a factor {n} = the world size: all_reduce SUMS the ranks' gradients; divide by "
                   f"self.world_size (once)")
        elif _close(g, expected / n):
            why = f"1/{n} of the mean: divided by the world size twice?"
        elif _close(g, own[name]):
            why = (f"still rank {rank}'s own gradient: it was never all-reduced (the call skipped, or made on a copy "
                   f"such as p.grad.clone() or a new tensor; all_reduce works in place)")
        elif _close(g, own[name] / n):
            why = "this rank's own gradient divided by the world size: divided, but the all-reduce never reached p.grad"
        elif _close(g, own[name] * n):
            why = "this rank's own gradient times the world size: the sum of something, but not of the ranks' gradients"
        elif g.abs().max().item() == 0:
            why = "all zeros"
        else:
            why = "not a simple multiple of the mean or of this rank's own gradient"
        return f"{head} — {why}{hint_step2}"
    return None


def check_average_gradient(n, results):
    for rank, res in enumerate(results):
        problem = gradient_problem(rank, n, res[0])
        if problem:
            return problem
    log = results[0][0]["log"]
    n_params = len(results[0][0]["expected"])
    if len(log) != n_params:
        return f"right gradients, but rank 0 made {len(log)} all-reduce calls for {n_params} parameters (one each)"
    return None


def check_on_gradient_ready(n, results):
    for rank, res in enumerate(results):
        for step in res:
            if step["unwaited"]:  # first: the values read after an unfinished all-reduce are anybody's guess
                problem = gradient_problem(rank, n, step)
                return (f"finish_sync returned without waiting for bucket {step['unwaited'][0]}'s "
                        f"all-reduce (rank {rank}, backward pass {step['step']}): call work.wait() on every "
                        f"outstanding bucket.work" + (
                            f". What the optimizer would read: {problem.split(' — ')[0]}" if problem else
                            " (this time the values had arrived anyway: a fast network hides this bug, a slow one "
                            "does not)"))
            hint = (" (the first backward pass was right: did you reset the bucket's count for the next one?)"
                    if step["step"] == 2 and gradient_problem(rank, n, res[0]) is None else "")
            problem = gradient_problem(rank, n, step, hint)
            if problem:
                return f"after backward pass {step['step']}: {problem}"
    res = results[0][0]
    log, sizes, total = res["log"], res["bucket_sizes"], res["total"]
    if any(not e["async_op"] for e in log):
        return ("right gradients, but the all-reduces are blocking: backward stops until each bucket has travelled. "
                "Pass async_op=True and keep the work handle in bucket.work")
    if len(log) != len(sizes):
        per = " (one per parameter: launch one per BUCKET, when its last gradient arrives)" if len(log) == total else ""
        return f"right gradients, but {len(log)} all-reduces for {len(sizes)} buckets{per}"
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    if log and log[0]["at"] >= total:
        return ("right gradients, but every all-reduce started only after the whole backward pass (in "
                "finish_sync?): nothing overlaps. Start each bucket's all-reduce in on_gradient_ready, as "
                "soon as its last gradient is ready")
    late = [i for i, (e, end) in enumerate(zip(log, ends)) if e["at"] != end]
    if late:
        i = late[0]
        return (f"right gradients, but bucket {i}'s all-reduce started when {log[i]['at']} gradients were ready; "
                f"its last one was gradient {ends[i]}: start it exactly when the bucket is complete")
    if res["waited_in_backward"]:
        return ("right gradients, but the all-reduces were waited on during backward (work.wait() right after "
                "launching?): backward stalls for each bucket; wait only in finish_sync")
    return None


def check_no_sync(n, results):
    for rank, res in enumerate(results):
        acc, exc, nested = res
        if any(acc["sent_inside"]):
            return (f"rank {rank} sent {sum(acc['sent_inside'])} all-reduce(s) inside `with model.no_sync():`; "
                    f"set self.sync = False for the duration of the block (the hook reads it)")
        if acc["sent_last"] == 0:
            return (f"rank {rank} sent nothing in the backward pass AFTER the no_sync blocks: synchronisation was "
                    f"not switched back on when the block ended")
        problem = gradient_problem(rank, n, acc)
        if problem:
            return f"after 2 micro-batches inside no_sync and 1 outside: {problem}"
        if not exc["sync_after_exception"]:
            return ("after an exception inside `with model.no_sync():`, synchronisation stays off: restore it in a "
                    "`finally:` around the yield")
        if nested["sync_after_inner_exit"] or nested["sent_nested"]:
            return ("leaving an inner `with model.no_sync():` switched synchronisation back on inside the outer "
                    "one: restore the PREVIOUS value of self.sync, not True")
        if not nested["sync_after_outer"]:
            return "after nested no_sync blocks, synchronisation stays off"
    return None


COMPARE = {"average_gradient": check_average_gradient, "on_gradient_ready": check_on_gradient_ready,
           "no_sync": check_no_sync}
SUCCESS = {"average_gradient": "every rank holds the mean gradient of all ranks' batches; one all-reduce per parameter",
           "on_gradient_ready": "2 backward passes right; one asynchronous all-reduce per bucket, started as the "
                                "bucket filled, all waited for in finish_sync",
           "no_sync": "nothing sent inside no_sync, the accumulated sum sent once after it; restored after an "
                      "exception and across nested blocks"}


# ------------------------------------------------------------------------- exercise 4: the bucket-size puzzle
MISTAKES = {  # what a value that matches the model with one mistake means
    "no_ring": "you used latency + bytes / bandwidth: a ring all-reduce over n ranks sends 2(n-1)/n of the buffer "
               "per rank, so a bucket takes latency + 2(n-1)/n * bytes / bandwidth",
    "no_latency": "your all-reduces pay no latency: every message, however small, costs `latency` once",
    "no_queue": "your all-reduces start as soon as their bucket is ready, even while the previous one is still on "
                "the link: one link sends one message at a time, so start = max(ready, end of the previous one)",
    "from_start": "you returned when the last all-reduce ends, counted from the START of backward: the exposed time "
                  "is what is left AFTER backward ends (subtract backward_s)",
    "strict": "your buckets close only when they hold MORE than bucket_bytes: close one as soon as it holds at "
              "least bucket_bytes (as DataParallel does)",
}


def _exposed(lesson, grad_bytes, backward_s, bucket_bytes, bandwidth, latency, n, mistake=None):
    """The overlap model's exposed time (experiment.model_timeline), or what it becomes with one of MISTAKES."""
    if mistake == "no_ring":
        bandwidth *= 2 * (n - 1) / n
    latency = 0.0 if mistake == "no_latency" else latency
    bucket_bytes += 1 if mistake == "strict" else 0  # bytes are integers: ">= b + 1" is "> b"
    buckets, exposed = lesson.model_timeline(grad_bytes, backward_s, bucket_bytes, latency, bandwidth, n)
    if mistake == "no_queue":
        return max(0.0, max(ready + end - start for ready, start, end, _ in buckets) - backward_s)
    return buckets[-1][2] if mistake == "from_start" else exposed


def _puzzle_cases(lesson):
    small = lesson.grad_tensor_bytes(lesson.make_cfg("small").model_config())  # the lesson's model: 39 tensors
    cases = [("one bucket for all of the lesson's model, 4 ranks", small, 0.1, 64 * 2**20, 2e8, 2e-3, 4),
             ("one bucket per tensor on a slow link (the messages queue)", small, 0.1, 0, 2e8, 2e-3, 2),
             ("1 MiB buckets, 4 ranks", small, 0.1, 2**20, 2e8, 2e-3, 4),
             ("ten tensors of 1000 bytes, buckets of 2000 bytes", [1000] * 10, 1.0, 2000, 1e4, 0.01, 2),
             ("1 MiB buckets on a fast link, 8 ranks", small, 0.1, 2**20, 1e10, 1e-5, 8)]
    backward = 0.14
    scenarios = [(f"the lesson's model, {1e3 * backward:.0f} ms of backward, on a link sized like section 4(c)'s "
                  f"(choose_link)", small, backward, *lesson.choose_link(sum(small), backward, 2), 2),
                 ("the same over a high-latency link (1 GB/s, 20 ms per message)", small, backward, 1e9, 0.02, 2),
                 ("the same over a fast link (1 GB/s, 0.1 ms per message)", small, backward, 1e9, 1e-4, 2)]
    return cases, scenarios


def _buckets(lesson, grad_bytes, mb):
    k = len(lesson.model_timeline(grad_bytes, 1.0, mb * 2**20, 0.0, 1.0)[0])
    return f"{k} bucket{'s' if k > 1 else ''}"


def check_puzzle_model(mod, path):
    """Your exposed_time against the model on a few cases, then your best_bucket_mb on a few links: a problem, or
    None."""
    lesson = _lesson()
    cases, scenarios = _puzzle_cases(lesson)
    got = []
    for label, *args in cases:
        try:
            value = mod.exposed_time(*args)
        except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check
            return f"exposed_time ({label}): {type(e).__name__}: {e}{where(e, path)}"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"exposed_time ({label}) returned {value!r}: return the exposed time in seconds, a number"
        got.append(float(value))

    def wrong(mistake=None):  # the cases where your value differs from the model with this mistake (None: none)
        return [(g, c) for g, c in zip(got, cases)
                if abs(g - _exposed(lesson, *c[1:], mistake=mistake)) > 1e-6 * max(1e-3, abs(g))]
    if wrong():
        known = next((m for m in MISTAKES if not wrong(m)), None)
        g, (label, *args) = wrong()[0]
        return (f"exposed_time ({label}): {1e3 * g:.3f} ms, the model says {1e3 * _exposed(lesson, *args):.3f} ms — "
                + (MISTAKES[known] if known else "compare your loop with the rules in the docstring, one bucket at a "
                   "time: when it is ready (backward_s x the bytes so far / all bytes), when it starts, when it ends"))
    for label, grad_bytes, backward, bandwidth, latency, n in scenarios:
        try:
            choice = mod.best_bucket_mb(grad_bytes, backward, bandwidth, latency, n, CANDIDATES_MB)
        except Exception as e:  # noqa: BLE001
            return f"best_bucket_mb ({label}): {type(e).__name__}: {e}{where(e, path)}"
        if choice not in CANDIDATES_MB:
            return f"best_bucket_mb ({label}) returned {choice!r}: return one of the candidates {CANDIDATES_MB}"
        exposed = {mb: _exposed(lesson, grad_bytes, backward, mb * 2**20, bandwidth, latency, n)
                   for mb in CANDIDATES_MB}
        best = min(exposed, key=exposed.get)
        if exposed[choice] > exposed[best] * (1 + 1e-9) + 1e-12:
            k, kb = _buckets(lesson, grad_bytes, choice), _buckets(lesson, grad_bytes, best)
            why = (f"smaller buckets pay the latency more often ({k}, {1e3 * latency:g} ms each)" if choice < best
                   else "bigger buckets start later, and the last one, ready only when backward ends, carries more "
                        "bytes")
            return (f"best_bucket_mb ({label}): you chose {choice:g} MiB ({k}), which leaves "
                    f"{1e3 * exposed[choice]:.1f} ms after backward; {best:g} MiB ({kb}) leaves "
                    f"{1e3 * exposed[best]:.1f} ms — {why}")
    return None


def check_bucket_size(path, report, timeout_s):
    """Exercise 4: the model check (no processes), then the real run over an emulated link (2 processes)."""
    what = EXERCISES["bucket_size"]
    try:
        problem = check_puzzle_model(load(path, "ex03"), path)
    except NotImplementedError as e:
        problem = f"NotImplementedError: {e}{where(e, path)}"
    if problem:
        report.fail(what, problem)
        return
    report.ok(what, ": right exposed times on 5 cases, the best bucket size on 3 links (the lesson's overlap model)")
    what = "best_bucket_mb, measured on an emulated link"
    timeout_s = max(timeout_s, REAL_RUN_TIMEOUT_S)
    results = attempt(lambda: run_on_ranks(_on_rank, 2, str(path), "bucket_size", str(SOLUTIONS),
                                           timeout_s=timeout_s), report, what, path, timeout_s)
    if results is None:
        return
    res = results[0]
    lesson, (bandwidth, latency) = _lesson(), res["link"]
    link = f"emulated link: {bandwidth / 1e6:g} MB/s, {1e3 * latency:g} ms latency, sized from a backward of " \
           f"{1e3 * res['backward']:.0f} ms"
    model = {name: _exposed(lesson, res["grad_bytes"], res["backward"], mb * 2**20, bandwidth, latency, 2)
             for name, mb in (("yours", res["choice"]), ("one bucket", max(CANDIDATES_MB)))}
    yours, one = res["rows"]["yours"]["wait"], res["rows"]["one bucket"]["wait"]
    total = latency + sum(res["grad_bytes"]) / bandwidth  # the link time of all gradients (n = 2)
    detail = (f"your {res['choice']:g} MiB ({res['rows']['yours']['n_buckets']} buckets) left {1e3 * yours:.1f} ms to "
              f"wait for after backward (model {1e3 * model['yours']:.1f} ms), one bucket {1e3 * one:.1f} ms (model "
              f"{1e3 * model['one bucket']:.1f} ms) [{link}]")
    if yours > 0.5 * one:
        report.fail(what, f"{detail}: buckets launched during backward should hide at least half of what one bucket "
                          f"exposes (a very busy machine? run the check again)")
    elif abs(yours - model["yours"]) > 0.25 * total + 0.005:
        report.fail(what, f"{detail}: the measurement is further from the model than 25% of the link's total time "
                          f"({1e3 * total:.0f} ms) + 5 ms (a very busy machine? run the check again)")
    else:
        report.ok(what, f": {detail}")


def check_one(name, path, report, timeout_s):
    if name == "bucket_size":
        return check_bucket_size(path, report, timeout_s)
    on_ranks(lambda n: f"{EXERCISES[name]} on {n} ranks", WORLD_SIZES,
             lambda n: run_on_ranks(_on_rank, n, str(path), name, str(SOLUTIONS), timeout_s=timeout_s),
             lambda n, results: (COMPARE[name](n, results), f": {SUCCESS[name]}"), report, path, timeout_s)


check, main = entry_points("Check lesson 03's exercises on 2 and 3 processes.", EXERCISES, check_one,
                           LEARNER, SOLUTIONS, TIMEOUT_S, "ex03")


if __name__ == "__main__":
    sys.exit(main())
