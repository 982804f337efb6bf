"""Start N processes that talk to each other: a test helper (`run_on_ranks`) and a torchrun wrapper.

run_on_ranks(fn, 4, x)   runs fn(x) in 4 fresh processes (ranks 0..3) that already share a gloo process
                         group, and returns [result of rank 0, ..., result of rank 3]. Every multi-rank test
                         and every lesson exercise checker goes through it, so it is built never to hang:

    parent                                   child r (a clean interpreter: "forkserver" or "spawn")
    ------                                   -------
    TCPStore server on a free port  <------  connects as a client, init_process_group(rank=r)
    wait on N pipes + N process handles      result = fn(*args, **kwargs)
      ("ok", value)       -> keep it    <--  sends ("ok", result) or ("error", traceback text)
      ("error", tb)       -> RankError       destroys the process group and exits
        (KeyboardInterrupt in a rank: Ctrl-C -> KeyboardInterrupt here too, so the caller stops)
      died, no message    -> RankError with its exit code
      deadline passed     -> RankTimeout, with the Python stack where each late rank is stuck
    finally: terminate, then kill, every child still alive, and reap it (no zombies)

The parent owns the rendezvous store, so there is no race for the port between "find a free port" and
"bind it". The process group's own timeout is the same deadline (plus 2 s, so the parent, which knows all
ranks, is the one to report a hang), so a collective that waits for a dead peer also ends. Each child runs
with OMP_NUM_THREADS=1 and torch.set_num_threads(1): four processes on two cores that each start a full
thread pool run ~10x slower.

`fn`, its arguments and its return value must be picklable: define fn at module level in an importable
file (not a lambda, not in a notebook cell), and guard a script's own code with
`if __name__ == "__main__":`, because spawned children re-import the main script.

run_torchrun(script, 4, args) runs `python -m torch.distributed.run --standalone --nproc_per_node 4 script
args` (what the lessons use), with a timeout, and raises with the tail of its output if it fails.

place() reads what a launcher (torchrun, or run_on_ranks) tells a process it starts: its rank, how many there are,
which start of the job this is. This is the one place that reads those variables; the trainer reads them once,
at the top of its main(), and passes them down (picotron.mesh, picotron.runs, picotron.faults take them as
arguments).

The environment variables picotron reads, all of them (the ones a user sets, and the ones launchers set):

    RANK, WORLD_SIZE          this process's rank and the job's size (torchrun, run_on_ranks): `place`
    LOCAL_RANK                its rank on this machine (which GPU): `place`
    LOCAL_WORLD_SIZE          the processes on this machine (how many GPUs they need; level-1 checkpoints'
                              nodes): `place`
    TORCHELASTIC_RESTART_COUNT  which start of the job this is (torchrun --max-restarts): `place`
    MASTER_ADDR, MASTER_PORT  where the ranks meet: read by torch.distributed's env:// rendezvous, not by us
    PICOTRON_RUN_FOLDER       the run folder the launching process claimed, for the workers it starts: `place`
    PICOTRON_LAUNCHER         how the user starts training (./run.sh says so): picotron.config.launcher
    PICOTRON_LAUNCHER_DEFAULTS  the launcher's own default flags (run.sh's --steps 600 ...), below the user's:
                              picotron.config.launcher_defaults
    OMP_NUM_THREADS           threads per process; unset, torchrun_main shares the cores out
    PICOTRON_START_METHOD, PICOTRON_PRELOAD, PICOTRON_RANK_TIMEOUT_S
                              run_on_ranks' start method, preloaded modules and hang guard (`_context`,
                              `run_on_ranks`)
    HF_HUB_OFFLINE, HF_ENDPOINT  Hugging Face's own: whether picotron.data may download a tokenizer, and from where
    TRITON_INTERPRET          Triton's own (read by triton at import): its kernels run under its interpreter;
                              picotron.kernels asks triton what it chose

Nothing else in picotron/ reads the environment or sys.argv (tests/test_edges.py checks it): config.py, launch.py
and data.py (Hugging Face's) read it, and the command line is read in `if __name__ == "__main__":`.
The lessons read their own settings (PICOTRON_FAST, PICOTRON_DEVICE, PICOTRON_NPROC: lessons/_common.py).
"""
import faulthandler
import multiprocessing as mp
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CLAIMED = "PICOTRON_RUN_FOLDER"  # set by the process that claimed the run folder, for the workers it starts


@dataclass(frozen=True)
class Place:
    """Where this process sits in the job, as its launcher said (`place()`); Place() is a process on its own.
    rank and local_rank are None when no launcher set them (with a process group already made, its rank
    stands in); local_world_size None: all the job's processes are on this machine."""
    launched: bool = False                  # WORLD_SIZE is set: torchrun (or a test harness) started this process
    rank: Optional[int] = None              # RANK
    world_size: int = 1                     # WORLD_SIZE
    local_rank: Optional[int] = None        # LOCAL_RANK
    local_world_size: Optional[int] = None  # LOCAL_WORLD_SIZE
    attempt: int = 0                        # TORCHELASTIC_RESTART_COUNT: 0, then 1, 2, ... after each restart
    claimed: Optional[str] = None           # PICOTRON_RUN_FOLDER: the folder the launching process claimed

    @property
    def says(self):
        """True on the process that speaks for the job (rank 0, or a process on its own)."""
        return (self.rank or 0) == 0

    def per_node(self, world_size=None):
        """The processes on this machine: LOCAL_WORLD_SIZE, else every process of the job."""
        return self.local_world_size or world_size or self.world_size


def place(environ=None):
    """This process's Place, read from `environ` (by default the environment): the one reader of the variables
    launchers set (this module's docstring lists them)."""
    env = os.environ if environ is None else environ

    def number(name):
        return int(env[name]) if env.get(name, "") != "" else None
    return Place(launched="WORLD_SIZE" in env, rank=number("RANK"), world_size=number("WORLD_SIZE") or 1,
                 local_rank=number("LOCAL_RANK"), local_world_size=number("LOCAL_WORLD_SIZE"),
                 attempt=number("TORCHELASTIC_RESTART_COUNT") or 0, claimed=env.get(CLAIMED) or None)


class RankError(RuntimeError):
    """A rank raised, or died, in run_on_ranks. Attributes: rank, traceback (text or None), exitcode."""

    def __init__(self, message, rank=None, traceback=None, exitcode=None):
        super().__init__(message)
        self.rank, self.traceback, self.exitcode = rank, traceback, exitcode


class RankTimeout(RankError):
    """Some ranks had not finished by the deadline (most likely a hang); `ranks` lists them."""

    def __init__(self, message, ranks=()):
        super().__init__(message, rank=ranks[0] if ranks else None)
        self.ranks = list(ranks)


class TorchrunError(RuntimeError):
    """run_torchrun failed or timed out; `output` holds everything it printed, `returncode` its exit status."""

    def __init__(self, message, output="", returncode=None):
        super().__init__(message)
        self.output, self.returncode = output, returncode


# --------------------------------------------------------------------------------------------- the child
def _child(rank, world_size, env, payload, conn, backend, timeout_s, init_group, stack_file):
    os.environ.update(env)  # before torch is imported in this process: OMP_NUM_THREADS, RANK, ...
    if stack_file and hasattr(signal, "SIGUSR1"):  # the parent asks for our stack if we look stuck
        faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=False)
    dist = None
    try:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # in case torch was imported already
        fn, args, kwargs = pickle.loads(payload)
        if init_group:
            import torch.distributed as dist

            timeout = timedelta(seconds=timeout_s + 2)  # a hair after the parent's deadline: it reports the hang
            if backend == "nccl":
                torch.cuda.set_device(int(env["LOCAL_RANK"]))
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        result = fn(*args, **kwargs)
        # Plain pickle, by value: multiprocessing's own pickler would pass tensors as shared-memory handles
        # that vanish when this process exits, before the parent reads them.
        try:
            reply = pickle.dumps(("ok", result))
        except Exception as e:
            reply = pickle.dumps(("error", f"fn returned a value that cannot be sent back to the parent (it must "
                                           f"be picklable; move tensors to CPU or return plain numbers): {e!r}"))
        conn.send_bytes(reply)
    except BaseException as e:  # also SystemExit / KeyboardInterrupt raised inside fn
        tb = e.__traceback__.tb_next or e.__traceback__  # start below this function's own frame
        conn.send_bytes(pickle.dumps(("error", "".join(traceback.format_exception(type(e), e, tb)))))
    finally:
        conn.close()
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


# -------------------------------------------------------------------------------------------- the parent
def _free_port():
    """A port that was free a moment ago (a small race remains; only used when init_group=False)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(start_method=None):
    """The multiprocessing context: "forkserver" where the OS has it, else "spawn".

    Both start children from a clean interpreter, never from a fork of the caller (which may hold threads,
    CUDA state or open process groups). spawn pays ~1.5 s per child to import torch (4 children on 2 cores:
    ~3 s per launch); the fork server imports torch once and forks each child from it (~0.1 s per launch).
    Only torch (torch._dynamo with it; pytest and numpy if the caller uses them) is preloaded, never project code,
    so edits to picotron or to an exercise file are seen by the next launch. PICOTRON_PRELOAD (comma-separated module names)
    adds modules to that list, for a caller that knows the code will not change while it runs: the test suite
    preloads picotron's own modules (tests/conftest.py), which saves each of its ~2,000 rank processes importing them.
    PICOTRON_START_METHOD=spawn (or start_method="spawn") selects spawn.
    """
    method = start_method or os.environ.get("PICOTRON_START_METHOD") or (
        "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        extra = [m for m in os.environ.get("PICOTRON_PRELOAD", "").split(",") if m]
        # torch._dynamo too: torch.optim's constructor imports it (and so does nn.init's normal_ on the meta
        # device), 1.7 s of each process's start on a 2-core machine, out of 2.4 s for a 3-step run
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"]
                                   + [m for m in ("numpy", "pytest") if m in sys.modules] + extra)
    return ctx


def run_on_ranks(fn, world_size, *args, timeout_s=None, backend="gloo", init_group=True, start_method=None,
                 **kwargs):
    """Run fn(*args, **kwargs) on `world_size` fresh processes; return the list of results, by rank.
    timeout_s: the hang guard, by default $PICOTRON_RANK_TIMEOUT_S or 60 s (the test suite sets 300: a busy
    machine may be slow, but never that slow).

    Each child has RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
    OMP_NUM_THREADS=1 in its environment and, unless init_group=False, an initialised default process group
    (`backend`, timeout = timeout_s) that is destroyed after fn returns. With init_group=False fn must
    initialise itself (e.g. `Mesh.init()` through env://). start_method: see `_context`.
    Raises RankError (the failing rank and its traceback, or its exit code) or RankTimeout; in every case
    all children are gone when this returns.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1.")
    if timeout_s is None:
        timeout_s = float(os.environ.get("PICOTRON_RANK_TIMEOUT_S", "60"))
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(f"run_on_ranks could not pickle fn={fn!r} or its arguments ({e}); define fn at module "
                        f"level in an importable .py file (not a lambda, closure or notebook cell).") from None
    store = None
    if init_group:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    port = store.port if store is not None else _free_port()
    common = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    ctx = _context(start_method)
    procs, conns, ok = [], [], False
    with tempfile.TemporaryDirectory(prefix="picotron-ranks-") as tmp:
        try:
            for rank in range(world_size):
                env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, name=f"rank{rank}",
                                args=(rank, world_size, env, payload, send, backend, timeout_s, init_group,
                                      os.path.join(tmp, f"rank{rank}.stack")))
                p.start()
                send.close()  # only the child holds the sending end: its death closes the pipe
                procs.append(p)
                conns.append(recv)
            results = _collect(procs, conns, timeout_s, tmp)
            ok = True
            return results
        finally:
            _stop(procs, grace_s=3.0 if ok else 0.0)
            for c in conns:
                c.close()
            del store


_PEER_GONE = ("closed by peer", "reset by peer", "Read error", "Write error", "Broken pipe")  # symptoms, not causes


def _collect(procs, conns, timeout_s, tmp):
    n, start = len(procs), time.monotonic()
    results, failures = {}, []  # failures: (rank, message, traceback text or None, exit code or None)
    pending = {conns[r]: r for r in range(n)}
    sentinels = {procs[r].sentinel: r for r in range(n)}
    grace_until = None  # after a first failure, listen briefly for the others' messages, then report
    while pending:
        now = time.monotonic()
        until = grace_until if grace_until is not None else start + timeout_s
        ready = wait(list(pending) + list(sentinels), timeout=max(0.0, until - now))
        if not ready:
            break
        for obj in ready:
            r = pending.get(obj, sentinels.get(obj))
            if r is None or conns[r] not in pending:
                continue  # already handled through its other handle
            conn, message = conns[r], None
            if conn.poll():  # a message, or end-of-file if the child died
                try:
                    message = pickle.loads(conn.recv_bytes())
                except EOFError:
                    pass
                except Exception as e:
                    message = ("error", f"the parent could not unpickle rank {r}'s result: {e!r}")
            elif obj is conn:
                continue
            if message is None:  # exited (or closed its pipe) without a word: it died hard
                procs[r].join(5)
                failures.append((r, f"rank {r} died without returning or raising ({_exit_reason(procs[r].exitcode)})",
                                 None, procs[r].exitcode))
            elif message[0] == "ok":
                results[r] = message[1]
            else:
                failures.append((r, f"rank {r} raised an exception", message[1], None))
            pending.pop(conn)
            sentinels.pop(procs[r].sentinel, None)
        if failures and grace_until is None:
            grace_until = time.monotonic() + 0.3
    if any(f[2] and f[2].rstrip().splitlines()[-1].startswith("KeyboardInterrupt") for f in failures):
        raise KeyboardInterrupt  # a rank got Ctrl-C (a terminal's or a kernel's interrupt): stop, not a failure
    if failures:  # report the likely cause first: a hard death, then an error that is not "my peer is gone"
        failures.sort(key=lambda f: 0 if f[2] is None else 2 if any(m in f[2] for m in _PEER_GONE) else 1)
        rank, message, tb, code = failures[0]
        others = [f"rank {f[0]}" + (f" ({f[2].strip().splitlines()[-1][:100]})" if f[2] else "") for f in failures[1:]]
        also = f" (also failed: {', '.join(others)})" if others else ""
        text = f"{message}{also}:\n{tb}" if tb else f"{message}{also}; its own error output, if any, is above."
        raise RankError(text, rank=rank, traceback=tb, exitcode=code)
    if pending:
        late = sorted(pending.values())
        stacks = _stacks(procs, late, tmp)
        who = f"rank {late[0]}" if len(late) == 1 else "ranks " + ", ".join(map(str, late))
        done = f" (finished: {', '.join(map(str, sorted(results)))})" if results else ""
        raise RankTimeout(f"{who} still running after {timeout_s:g} s: hang?{done}{stacks}", ranks=late)
    return [results[r] for r in range(n)]


def _exit_reason(code):
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stacks(procs, ranks, tmp):
    """Ask the late ranks for their Python stacks (faulthandler on SIGUSR1) to show where they wait."""
    if not hasattr(signal, "SIGUSR1"):
        return ""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.2)
    out = []
    for r in ranks:
        try:
            with open(os.path.join(tmp, f"rank{r}.stack")) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        lines = text.splitlines()
        cut = [i for i, line in enumerate(lines) if line.endswith(" in _child")]
        text = "\n".join(lines[1:cut[0]] if cut else lines[1:])  # fn's frames only, innermost first
        if text:
            out.append(f"\n--- where rank {r} was (most recent call first) ---\n{text}")
    return "".join(out)


def _stop(procs, grace_s):
    """Give children grace_s to exit on their own, then terminate and finally kill the rest; reap every one."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join()
        p.close()


# ------------------------------------------------------------------------------------------------ torchrun
def torchrun_cmd(script, nproc, args=(), module=False, nnodes=1, node_rank=None, rdzv_endpoint=None,
                 rdzv_id="picotron", max_restarts=0):
    """The torchrun command line: `python -m torch.distributed.run --standalone --nproc_per_node N script args`
    (module=True runs `-m script`, e.g. torchrun_cmd("picotron.train", 4, ["--dp", "4"], module=True)).

    nnodes > 1 (N processes on each of nnodes machines, every one running this same command): the nodes meet at
    `rdzv_endpoint` (HOST:PORT) instead of --standalone's private one. With `node_rank`, torchrun's static
    rendezvous: node R gets global ranks R*N to R*N+N-1 and node 0 (rank 0, which logs and picks the checkpoint
    to resume) must be the endpoint's host. Without it, the c10d rendezvous under the job name `rdzv_id`: torchrun
    numbers the nodes itself (by host name) and the endpoint may be any of them."""
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes > 1:
        cmd += ["--nnodes", str(nnodes), "--rdzv-endpoint", str(rdzv_endpoint), "--rdzv-id", str(rdzv_id)]
        cmd += ["--rdzv-backend", "c10d"] if node_rank is None else ["--rdzv-backend", "static", "--node-rank",
                                                                      str(node_rank)]
    else:
        cmd += ["--standalone"]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    cmd += ["--nproc_per_node", str(nproc)]
    return cmd + (["-m", str(script)] if module else [str(script)]) + [str(a) for a in args]


def run_torchrun(script, nproc, args=(), timeout_s=600, module=False, env=None, cwd=None, check=True):
    """Run torchrun with OMP_NUM_THREADS=1 and this repository on PYTHONPATH; return a CompletedProcess.

    stdout and stderr are merged (in order) into `.stdout`. If it exits non-zero (check=True) or runs past
    timeout_s, the whole process tree is stopped and TorchrunError carries the tail of the output.
    """
    cmd = torchrun_cmd(script, nproc, args, module)
    full_env = _env({"OMP_NUM_THREADS": "1", **(env or {})})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            cwd=cwd, start_new_session=True)  # own process group: a timeout stops all of it
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out = _stop_tree(proc)
        raise TorchrunError(f"{' '.join(cmd[3:])} still running after {timeout_s:g} s: hang? Last output:\n"
                            f"{_tail(out)}", out, None) from None
    except BaseException:  # e.g. Ctrl-C in a notebook: do not leave workers behind
        _stop_tree(proc)
        raise
    if check and proc.returncode != 0:
        raise TorchrunError(f"{' '.join(cmd[3:])} exited with code {proc.returncode}. Last output:\n{_tail(out)}",
                            out, proc.returncode)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _env(overrides):
    """This process's environment with `overrides` and this repository first on PYTHONPATH."""
    env = {**os.environ, **overrides}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


def threads_per_process(nproc, cores=None):
    """OMP_NUM_THREADS for nproc processes on this machine: the cores shared out, at least one each. Processes
    that each start a thread pool as wide as the machine fight over the cores (4 on 2 cores: ~10x slower)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // nproc)


def torchrun_main(module, nproc, argv, max_restarts=0, hint=None, claimed=None, **nodes):
    """`python -m picotron.train --dp 2 ...` on one machine: run torchrun for it and return the exit status.
    `nodes` (nnodes, node_rank, rdzv_endpoint, rdzv_id): this machine is one of several (`torchrun_cmd`), nproc
    processes here.

    The settings were validated before this is called, so a bad one never starts a process. The workers'
    output streams through, except the job's final `picotron: error:/stopped:` line (a divergence, Ctrl-C):
    that is held back, torchrun's failure report that follows it is left out, and the line is printed last.
    A rank that dies (killed, crashed) is named in one line instead of torchrun's report: with restarts left
    (`max_restarts`, torchrun's --max-restarts) every rank starts again and resumes; else the job ends, and
    `hint()` says where the newest checkpoint is. Ctrl-C reaches the workers through torchrun: they finish
    the step, save a checkpoint and say so. OMP_NUM_THREADS, unless set, shares the cores out. `claimed`: the run
    folder this process checked and claimed, handed to the workers ($PICOTRON_RUN_FOLDER: they need not again).
    """
    cmd = torchrun_cmd(module, nproc, argv, module=True, max_restarts=max_restarts, **nodes)
    env = _env({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_process(nproc))),
                **({CLAIMED: os.path.abspath(claimed)} if claimed else {})})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun gets Ctrl-C too and passes it on
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        last = None  # the job's own last word: "picotron: error: ..." or "picotron: stopped: ..."
        lost, failures = None, 0  # the rank torchrun saw fail last, and how often a worker group failed
        for line in proc.stdout:
            failed = _WORKER_FAILED.search(line)
            if line.startswith(("picotron: error:", "picotron: stopped:")):
                last = line.rstrip("\n")  # held back: printed once, at the very end
            elif failed and last is None:
                failures += 1
                lost = f"rank {failed.group(2)} died ({_exit_reason(int(failed.group(1)))})"
                if failures <= max_restarts:
                    print(f"picotron: {lost}; restart {failures} of {max_restarts}: torchrun starts every rank again "
                          f"and they resume from the newest checkpoint", flush=True)
            elif last is None and failures <= max_restarts and not _TORCHRUN_CHATTER.search(line):
                print(line, end="", flush=True)  # (after the last failure: torchrun's report, left out)
        code = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    if last:  # torchrun's own report of the failed workers, which followed it, is left out
        print(last, file=sys.stderr, flush=True)
        code = 2 if last.startswith("picotron: error:") else 130 if "interrupted" in last else code or 1
    elif code and lost:
        restarts = f" after {max_restarts} restart{'s' if max_restarts > 1 else ''}" if max_restarts else ""
        print(f"picotron: stopped: {lost}{restarts}; torchrun stopped the other ranks"
              + (f"; {hint()}" if hint else "") + ".", file=sys.stderr, flush=True)
    return code


# torchrun's line when a worker dies or fails: "failed (exitcode: -9) local_rank: 1 (pid: 7903) of binary: ..."
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# torchrun's log lines while it passes Ctrl-C on to the workers (they say what happens themselves)
_TORCHRUN_CHATTER = re.compile(r"^[WI]\d{4} .*torch/distributed/elastic/.*(death signal|closing signal)")


def _stop_tree(proc):
    for sig in (signal.SIGTERM, signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM):
        try:
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, sig)
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return proc.communicate(timeout=5)[0] or ""
        except subprocess.TimeoutExpired:
            continue
    return ""


def _tail(text, lines=40):
    """The last lines of a run's output; when torchrun reports a failed worker, the lines BEFORE its report (the
    worker's own error, which the report's ~40 lines would push out) and the report's first line."""
    all_lines = (text or "").rstrip().splitlines()
    report = next((i for i, line in enumerate(all_lines) if "failed (exitcode:" in line), None)
    if report is None:
        return "\n".join(all_lines[-lines:])
    return "\n".join(all_lines[max(0, report - lines + 1):report] + [all_lines[report]])
