"""Faults, with real processes and real kills (SIGKILL): a lost rank ends the job with its name, restarts
resume from the newest complete checkpoint and finish with the uninterrupted run's losses bit for bit, a kill
during a checkpoint write leaves the previous one usable, a non-finite step is skipped when asked."""
import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from picotron import checkpoint, reshard
from picotron.config import Config, ConfigError
from picotron.metrics import read_metrics
from picotron.parallelize import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
QUICK = ["--seq-len", "32", "--micro-batch-size", "4", "--sample-tokens", "0", "--eval-every", "0",
         "--log-every", "1", "--warmup-steps", "2"]


def picotron(*args, timeout=300):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "picotron.train", *map(str, args), *QUICK], capture_output=True,
                          text=True, cwd=ROOT, env=ENV, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0


def losses(out):
    return [r["loss"] for r in read_metrics(str(out))[0]]


def test_a_killed_rank_ends_the_job_naming_it(tmp_path):
    """Rank 1 of 2 dies in step 3 while rank 0 waits in a collective: the job ends at once (torchrun stops the
    other rank), with one line naming the lost rank and the newest checkpoint, no traceback."""
    code, out, err, seconds = picotron("--dp", 2, "--steps", 6, "--save-every", 2, "--out", tmp_path,
                                       "--faults", "kill@3:r1")
    assert code == 1, err
    assert "picotron: fault injected: rank 1 kills itself during step 3" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("picotron: stopped: rank 1 died (killed by signal SIGKILL); torchrun stopped the other "
                           "ranks; newest checkpoint "), err
    assert "step_000002" in last and "--resume" in last
    assert "Traceback" not in out + err and "ChildFailedError" not in out + err
    assert seconds < 240  # a hang guard below the collective timeout (300 s): the job did not wait for it


@pytest.mark.heavy  # the heavy tier: 30 s of random kills; the default tier kills at fixed steps (the same restart paths)
def test_faults_at_random_steps_finish_with_the_uninterrupted_losses(tmp_path):
    """dp2 + ZeRO-1, 10 steps, a checkpoint every 2: two kills at random steps (random ranks) and one during a
    checkpoint write; torchrun restarts three times, each attempt resumes from the newest complete checkpoint, and
    every step's loss, the last included, equals the run without faults bit for bit (CPU, fp32)."""
    rng = random.Random(2026)
    kill_steps = sorted(rng.sample(range(2, 11), 2))
    save_step = rng.choice([s for s in range(2, 11, 2) if s > kill_steps[0]])
    faults = f"kill@{kill_steps[0]}:r{rng.randrange(2)},kill-save@{save_step}:r{rng.randrange(2)},kill@{kill_steps[1]}"
    common = ["--dp", 2, "--zero", 1, "--steps", 10, "--save-every", 2]
    code, _, err, _ = picotron(*common, "--out", tmp_path / "clean")
    assert code == 0, err
    code, out, err, _ = picotron(*common, "--out", tmp_path / "faulty", "--faults", faults, "--max-restarts", 3)
    assert code == 0, f"{faults}\n{out[-3000:]}\n{err[-3000:]}"
    assert out.count("picotron: fault injected") == 3 and out.count("resuming from") == 3, out
    assert losses(tmp_path / "faulty") == losses(tmp_path / "clean"), faults
    assert [r["step"] for r in read_metrics(str(tmp_path / "faulty"))[0]] == list(range(1, 11))


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_one(tmp_path):
    """Rank 0 dies while writing step 4's checkpoint: `latest` still names step 2's, complete and loadable; the
    half-written folder is never taken for a checkpoint, and the next start clears it away."""
    code, out, err, _ = picotron("--dp", 2, "--steps", 6, "--save-every", 2, "--out", tmp_path,
                                 "--faults", "kill-save@4:r0")
    assert code == 1 and "rank 0 died (killed by signal SIGKILL)" in err, err
    folder = checkpoint.latest(str(tmp_path))
    assert folder.endswith("step_000002")
    assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "step_000004.tmp"))
    assert reshard.consolidate(folder)["step"] == 2
    code, out, err, _ = picotron("--dp", 2, "--steps", 6, "--save-every", 2, "--out", tmp_path, "--resume")
    assert code == 0, err
    assert f"resuming from {folder} at step 3" in out
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["latest", "step_000002", "step_000004",
                                                                         "step_000006"]


@pytest.mark.heavy  # 25 s; lesson 10's FAST run kills a node for real, test_checkpoint covers the paths
def test_lost_nodes_resume_from_level_1_with_the_uninterrupted_losses(tmp_path):
    """dp2 as two nodes (--ranks-per-node 1), level 1 every 2 steps, level 2 every 4. Node 0 lost in step 7 (its
    level-1 folder deleted, then SIGKILL): the restart resumes from level 1's step 6, rank 0's shard from node 1's
    copy, rank 1's from its own. Node 1 lost in step 8, before any new level-1 save: the restart resumes from level
    1's step 6 again, rank 1's shard from node 0, whose copy the first restart had sent again (without it: level
    2's step 4). Every step's loss equals the run without faults, bit for bit."""
    common = ["--dp", 2, "--steps", 8, "--save-every", 4, "--local-save-every", 2, "--ranks-per-node", 1]
    code, _, err, _ = picotron(*common, "--out", tmp_path / "clean")
    assert code == 0, err
    code, out, err, _ = picotron(*common, "--out", tmp_path / "faulty", "--faults", "lose-node@7:r0,lose-node@8:r1",
                                 "--max-restarts", 2)
    assert code == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert "picotron: fault injected: rank 0 loses its node and kills itself during step 7" in out, out
    assert "restart 1: resuming from level 1 (node-local) step 6, rank 0 from the next node's copy at step 7" in out
    assert "restart 2: resuming from level 1 (node-local) step 6, rank 1 from the next node's copy at step 7" in out
    assert losses(tmp_path / "faulty") == losses(tmp_path / "clean")
    assert [r["step"] for r in read_metrics(str(tmp_path / "faulty"))[0]] == list(range(1, 9))


def test_a_non_finite_step_is_skipped_when_asked(tmp_path):
    """--on-nonfinite skip: step 3's loss is NaN on every rank; the step is logged as skipped, its update dropped
    (the parameters and Adam's state after step 3 are those after step 2), and training goes on."""
    code, out, err, _ = picotron("--dp", 2, "--steps", 5, "--save-every", 1, "--keep-checkpoints", 0, "--out",
                                 tmp_path, "--faults", "nan@3", "--on-nonfinite", "skip")
    assert code == 0, err
    assert "picotron: step 3 skipped: loss nan" in out
    records = read_metrics(str(tmp_path))[0]
    assert [bool(r.get("skipped")) for r in records] == [False, False, True, False, False]
    ckpt = {s: reshard.consolidate(checkpoint.step_dir(str(tmp_path), s)) for s in (2, 3)}
    for name, p in ckpt[2]["params"].items():
        assert torch.equal(p, ckpt[3]["params"][name]), name
        assert ckpt[3]["optimizer"][name]["step"] == 2.0
    assert records[-1]["loss"] < records[0]["loss"]


def test_a_non_finite_step_stops_by_default(tmp_path):
    code, out, err, _ = picotron("--steps", 5, "--save-every", 1, "--out", tmp_path, "--faults", "nan@3")
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("picotron: stopped: the run diverged at step 3: loss nan")


@pytest.mark.parametrize("settings,message", [
    (dict(faults="kill@x"), "faults item 'kill@x' is not kill@STEP"),
    (dict(faults="kill@99"), "faults item kill@99 is outside steps 1..10"),
    (dict(faults="kill@3:r5", dp=2), "names rank 5 but the run has 2 ranks"),
    (dict(faults="kill-save@3", save_every=2), "names a step without a checkpoint (save_every=2)"),
    (dict(max_restarts=2), "max_restarts=2 without checkpoints would restart from step 1"),
    (dict(on_nonfinite="ignore"), "on_nonfinite='ignore' is not one of the known values"),
    (dict(faults="lose-node@x"), "faults item 'lose-node@x' is not kill@STEP, kill-save@STEP, lose-node@STEP"),
    (dict(faults="kill-save@3", save_every=4, local_save_every=2), "names a step without a checkpoint"),
    (dict(local_save_every=2), "local_save_every=2 must be below save_every=0: level 1 is the frequent level"),
    (dict(local_save_every=4, save_every=4), "local_save_every=4 must be below save_every=4"),
    (dict(local_dir="/tmp/x", save_every=4), "--local-dir configures level-1 checkpoints, which are off"),
    (dict(local_save_every=1, save_every=4, ranks_per_node=3, dp=2),
     "ranks_per_node=3 does not divide the 2 ranks into whole nodes; pick --ranks-per-node in {1, 2}"),
])
def test_bad_fault_settings_get_one_sentence(settings, message):
    cfg = Config(steps=10, **settings)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as e:
        validate(cfg, any_world_size=True)
    assert "\n" not in str(e.value)


def test_the_index_is_one_slice_per_line(tmp_path):
    code, _, err, _ = picotron("--steps", 1, "--save-every", 1, "--out", tmp_path)
    assert code == 0, err
    lines = open(os.path.join(checkpoint.latest(str(tmp_path)), "rank_00000.json")).read().splitlines()
    assert len(lines) == 2 + len(reshard.Reader(checkpoint.latest(str(tmp_path))).ranks[0]["slices"])
    assert json.loads("\n".join(lines))["step"] == 1
