"""run_on_ranks (the multi-rank test helper) and the torchrun wrapper: results, errors, hangs, hard deaths."""
import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from picotron.launch import (RankError, RankTimeout, TorchrunError, run_on_ranks, run_torchrun, torchrun_cmd)


def _alive(pid):
    """True if the process exists, zombies included (a zombie still answers signal 0)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def assert_no_children_left(pid_dir=None):
    assert multiprocessing.active_children() == []
    for name in os.listdir(pid_dir) if pid_dir else []:
        pid = int(open(os.path.join(pid_dir, name)).read())
        assert not _alive(pid), f"child {pid} ({name}) still exists"


def _write_pid(pid_dir):
    with open(os.path.join(pid_dir, f"rank{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))


# ------------------------------------------------------------------------------------- functions run on ranks
def _info(x, scale=1):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(), "sum": t.item(),
            "x": x * scale, "env": env, "threads": torch.get_num_threads(), "pid": os.getpid()}


def _raise_on_rank_1(pid_dir):
    _write_pid(pid_dir)
    if dist.get_rank() == 1:
        raise ValueError("wrong value on rank 1")
    dist.barrier()  # rank 0 waits here for a peer that is gone: it must be killed, not left hanging


def _hang_on_rank_0(pid_dir):
    _write_pid(pid_dir)
    if dist.get_rank() == 0:
        time.sleep(3600)  # the learner forgot to call the collective on rank 0
    dist.all_reduce(torch.zeros(1))


def _exit_hard(code):
    if dist.get_rank() == 1:
        os._exit(code)
    dist.barrier()


def _killed_by_signal():
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _return_unpicklable():
    return lambda: 1


def _no_group():
    return dist.is_initialized(), os.environ["MASTER_PORT"]


# ------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_values_in_rank_order(world_size):
    environ = dict(os.environ)
    out = run_on_ranks(_info, world_size, 21, scale=2)
    assert [o["rank"] for o in out] == list(range(world_size))
    for rank, o in enumerate(out):
        assert o["world"] == world_size and o["backend"] == "gloo" and o["x"] == 42
        assert o["sum"] == world_size * (world_size + 1) / 2  # the process group really works
        assert o["env"]["RANK"] == o["env"]["LOCAL_RANK"] == str(rank) and o["env"]["WORLD_SIZE"] == str(world_size)
        assert o["env"]["MASTER_ADDR"] == "127.0.0.1" and o["env"]["OMP_NUM_THREADS"] == "1" and o["threads"] == 1
    assert len({o["env"]["MASTER_PORT"] for o in out}) == 1 and len({o["pid"] for o in out}) == world_size
    assert_no_children_left()
    assert dict(os.environ) == environ  # the parent's environment is untouched


def test_spawn_start_method_also_works():
    out = run_on_ranks(_info, 2, 1, start_method="spawn")
    assert [o["sum"] for o in out] == [3.0, 3.0]


def test_child_exception_surfaces_rank_and_traceback(tmp_path):
    with pytest.raises(RankError) as e:
        run_on_ranks(_raise_on_rank_1, 2, str(tmp_path), timeout_s=600)  # a hang guard only
    msg = str(e.value)
    assert e.value.rank == 1 and not isinstance(e.value, RankTimeout)
    assert msg.startswith("rank 1 raised an exception")
    assert "Traceback (most recent call last)" in msg and "ValueError: wrong value on rank 1" in msg
    assert "test_launch.py" in msg and "_raise_on_rank_1" in msg  # the learner's own frame is shown
    assert "ValueError: wrong value on rank 1" in e.value.traceback  # ended by the error, not by the timeout
    assert_no_children_left(str(tmp_path))


def test_hang_raises_rank_timeout_and_shows_where(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as e:
        # 10 s: far above the few seconds forked ranks need to reach the hang on a busy machine, so the stack shows it
        run_on_ranks(_hang_on_rank_0, 2, str(tmp_path), timeout_s=10)
    elapsed = time.monotonic() - t0
    msg = str(e.value)
    assert "still running after 10 s: hang?" in msg and e.value.ranks == [0, 1]
    assert "where rank 0 was" in msg and "_hang_on_rank_0" in msg  # faulthandler stack of the stuck rank
    assert isinstance(e.value, RankError)
    assert elapsed < 10 + 290, elapsed  # a hang guard: ended by the timeout, not by pytest's patience
    assert_no_children_left(str(tmp_path))


def test_exit_without_exception_is_a_rank_error():
    with pytest.raises(RankError) as e:
        run_on_ranks(_exit_hard, 2, 3, timeout_s=30)
    assert e.value.rank == 1 and e.value.exitcode == 3 and e.value.traceback is None
    assert "rank 1 died without returning or raising (exit code 3)" in str(e.value)
    assert_no_children_left()


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_killed_by_signal_is_a_rank_error():
    with pytest.raises(RankError, match="rank 0 died without returning or raising \\(killed by signal SIGKILL\\)"):
        run_on_ranks(_killed_by_signal, 2, timeout_s=30)
    assert_no_children_left()


def test_unpicklable_function_is_refused_up_front():
    with pytest.raises(TypeError, match="module level"):
        run_on_ranks(lambda: 1, 2)
    assert_no_children_left()


def test_unpicklable_result_is_explained():
    with pytest.raises(RankError, match="cannot be sent back to the parent"):
        run_on_ranks(_return_unpicklable, 1)


def test_init_group_false_leaves_the_group_to_fn():
    out = run_on_ranks(_no_group, 2, init_group=False)
    assert [o[0] for o in out] == [False, False] and out[0][1] == out[1][1]


# ------------------------------------------------------------------------------------------------- torchrun
SCRIPT_OK = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1); dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item():.0f} threads {os.environ['OMP_NUM_THREADS']}", flush=True)
dist.destroy_process_group()
"""
SCRIPT_FAIL = "import sys\nprint('about to fail', flush=True)\nsys.exit('bad things on purpose')\n"
SCRIPT_HANG = "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(3600)\n"


def test_torchrun_cmd():
    cmd = torchrun_cmd("lessons/01.py", 4, ["--steps", 3])
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                   "lessons/01.py", "--steps", "3"]
    assert torchrun_cmd("picotron.train", 2, module=True)[-2:] == ["-m", "picotron.train"]


def test_torchrun_cmd_on_several_nodes():
    """One node: --standalone (unchanged). Several: the nodes meet at the endpoint: c10d (torchrun numbers the
    nodes) or, with a node rank, the static rendezvous (node R holds ranks R*n ... R*n+n-1)."""
    head = [sys.executable, "-m", "torch.distributed.run"]
    c10d = torchrun_cmd("picotron.train", 8, ["--dp", 16], module=True, nnodes=2, rdzv_endpoint="n0:29500",
                        max_restarts=2)
    assert c10d == head + ["--nnodes", "2", "--rdzv-endpoint", "n0:29500", "--rdzv-id", "picotron", "--rdzv-backend",
                           "c10d", "--max-restarts", "2", "--nproc_per_node", "8", "-m", "picotron.train", "--dp", "16"]
    static = torchrun_cmd("picotron.train", 8, module=True, nnodes=2, node_rank=1, rdzv_endpoint="n0:29500",
                          rdzv_id="job")
    assert static[3:13] == ["--nnodes", "2", "--rdzv-endpoint", "n0:29500", "--rdzv-id", "job", "--rdzv-backend",
                            "static", "--node-rank", "1"]
    assert torchrun_cmd("x.py", 2, max_restarts=1)[3:6] == ["--standalone", "--max-restarts", "1"]


def test_run_torchrun_ok(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text(SCRIPT_OK)
    r = run_torchrun(str(script), 2, timeout_s=120)
    assert r.returncode == 0
    assert "rank 0 sum 2 threads 1" in r.stdout and "rank 1 sum 2 threads 1" in r.stdout


def test_run_torchrun_failure_has_output_tail(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(SCRIPT_FAIL)
    with pytest.raises(TorchrunError) as e:
        run_torchrun(str(script), 1, timeout_s=120)
    assert e.value.returncode != 0 and "exited with code" in str(e.value)
    assert "about to fail" in str(e.value) and "bad things on purpose" in e.value.output


def test_a_worker_killed_by_a_signal_keeps_its_last_words(tmp_path):
    """A worker that aborts (SIGABRT, as a C++ error in a communication thread does): torchrun's own report
    (about 40 lines) does not push the worker's last output out of the message."""
    script = tmp_path / "abort.py"
    script.write_text("import os, sys\nfor i in range(5):\n    print('worker line', i, flush=True)\n"
                      "print('the cause: something broke', file=sys.stderr, flush=True)\nos.abort()\n")
    with pytest.raises(TorchrunError) as e:
        run_torchrun(str(script), 1, timeout_s=120)
    assert "the cause: something broke" in str(e.value) and "exitcode: -6" in str(e.value), str(e.value)


def test_run_torchrun_timeout_kills_the_workers(tmp_path):
    script, pid_file = tmp_path / "hang.py", tmp_path / "pid"
    script.write_text(SCRIPT_HANG)
    # 15 s: above torchrun's start-up (it imports torch: ~3 s idle, ~10 s on a loaded 2-core machine), so the
    # worker has written its pid before the timeout stops it
    with pytest.raises(TorchrunError, match="still running after 15 s: hang?"):
        run_torchrun(str(script), 1, [str(pid_file)], timeout_s=15)
    pid = int(pid_file.read_text())
    for _ in range(50):  # the worker was signalled; give the kernel a moment to reap it
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid)


def test_launched_processes_share_the_cores_out():
    from picotron.launch import threads_per_process
    assert [threads_per_process(n, cores=8) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    assert threads_per_process(4, cores=2) == 1 and threads_per_process(1) >= 1
