"""What a newcomer meets in the first hour: set-up, bad inputs, a diverging run, Ctrl-C, --help.

Every bad input reads its one sentence (the value, the rule, a fix) and no traceback; a run that turns NaN
stops at that step and keeps the last good checkpoint; Ctrl-C on a real run prints one line and leaves a
checkpoint that resumes; a second ./run.sh skips set-up and never overwrites an earlier run.
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from picotron import checkpoint, config, data
from picotron import parallelize as parallelize_mod
from picotron import train as train_mod
from picotron.config import Config, ConfigError
from picotron.marks import clip_grad_norm
from picotron.mesh import Mesh
from picotron.metrics import read_metrics
from picotron.parallelize import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
QUICK = ["--seq-len", "32", "--micro-batch-size", "4", "--eval-every", "0", "--sample-tokens", "0",
         "--warmup-steps", "0"]


def picotron(*args, timeout=300, env=None):
    """`python -m picotron.train ARGS` as a user runs it: (exit status, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "picotron.train", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**ENV, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


def one_line_error(stderr):
    """The error output is one line, 'picotron: error: ...', and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("picotron: error: "), stderr
    return lines[0]


def error_of(**fields):
    with pytest.raises(ConfigError) as e:
        validate(Config(**fields), 1)
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith(".") and ";" in msg, msg
    return msg


# ------------------------------------------------------------------------------------- hyperparameters
@pytest.mark.parametrize("field", ["lr", "min_lr", "grad_clip", "weight_decay", "beta1", "bucket_mb"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_numbers_are_refused(field, value):
    msg = error_of(**{field: value})
    assert msg.startswith(f"{field}={value} is not a finite number") and f"--{field.replace('_', '-')}" in msg


def test_absurd_learning_rate_is_refused():
    msg = error_of(lr=1e6)
    assert msg.startswith("lr=1e+06 is above 1") and "--lr 3e-3" in msg
    validate(Config(lr=0.5, min_lr=0.0), 1)


def test_inf_from_the_command_line_is_one_sentence():
    code, out, err = picotron("--lr", "inf")
    assert code == 2 and "lr=inf is not a finite number" in one_line_error(err)


# ------------------------------------------------------------------------------------- divergence
def test_a_nan_loss_stops_the_run_at_that_step_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """Force the loss to NaN from step 3 on: the run stops there, before the optimizer applies it."""
    calls = []

    def poisoned(logits, targets):  # one call per micro-batch: 2 per step here
        calls.append(1)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return loss * math.nan if len(calls) > 4 else loss

    monkeypatch.setattr(parallelize_mod, "loss_fn", poisoned)  # the loss parallelize hands the trainer
    cfg = Config(steps=10, grad_acc=2, save_every=1, out=str(tmp_path), seq_len=32, micro_batch_size=4,
                 eval_every=0, sample_tokens=0, log_every=100)
    with Mesh.init() as mesh:
        with pytest.raises(train_mod.Stopped) as e:
            train_mod.train(cfg, mesh)
    msg = str(e.value)
    assert e.value.code == 1 and "\n" not in msg
    assert msg.startswith("picotron: stopped: the run diverged at step 3: loss nan")
    assert "--lr" in msg and "step_000002" in msg and "--resume" in msg
    assert checkpoint.latest(str(tmp_path)).endswith("step_000002")  # the NaN step was never saved
    state = torch.load(os.path.join(checkpoint.latest(str(tmp_path)), "rank_00000.pt"), weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["tensors"].values())
    steps, summary = read_metrics(str(tmp_path))
    assert [r["step"] for r in steps] == [1, 2] and summary is None


def test_grad_clip_zero_means_off():
    """--grad-clip 0 leaves the gradients alone (it used to scale them by 0/norm = 0) and still reports the norm."""
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    assert clip_grad_norm([p], 0.0, Mesh.local()) == pytest.approx(5.0)
    assert p.grad.tolist() == [3.0, 4.0, 0.0]
    assert clip_grad_norm([p], 1.0, Mesh.local()) == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_grad_clip_zero_trains(tmp_path):
    cfg = Config(steps=8, grad_clip=0.0, out=str(tmp_path), seq_len=32, micro_batch_size=4, eval_every=0,
                 sample_tokens=0, log_every=100, warmup_steps=0)
    with Mesh.init() as mesh:
        summary = train_mod.train(cfg, mesh)
    steps, _ = read_metrics(str(tmp_path))
    assert summary["final_loss"] < steps[0]["loss"] - 0.5  # it used to stay at 5.57: every update was zero


# ------------------------------------------------------------------------------------- data and tokenizer
def test_empty_data_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    msg = error_of(data=str(tmp_path / "empty.txt"))
    assert "is empty" in msg and "seq-len" not in msg


def test_short_data_file_proposes_a_seq_len_that_fits(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("To be, or not to be, that is the question. " * 40)  # 1,720 bytes: the val split has 86
    msg = error_of(data=str(path))
    assert "holds 1,720 tokens, too few for seq_len=128" in msg and "--seq-len 85 or less" in msg
    validate(Config(data=str(path), seq_len=85), 1)  # the proposed fix works
    with pytest.raises(ConfigError):
        validate(Config(data=str(path), seq_len=86), 1)  # and it is the longest that does


def test_binary_data_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 10)
    msg = error_of(data=str(path))
    assert "is not UTF-8 text" in msg and "byte 128 is 0x80" in msg


def test_folder_without_text(tmp_path):
    (tmp_path / "notes.md").write_text("# not a .txt")
    assert "holds no *.txt file" in error_of(data=str(tmp_path))


def test_data_errors_read_one_line_on_the_command_line(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    code, out, err = picotron("--data", tmp_path / "empty.txt")
    assert code == 2 and "is empty" in one_line_error(err)


def test_unknown_tokenizer_is_one_sentence_and_quick(tmp_path):
    msg = error_of(tokenizer=str(tmp_path / "no-such-folder"))
    assert "is not an existing folder" in msg and "--tokenizer byte" in msg
    t0 = time.monotonic()
    code, out, err = picotron("--tokenizer", "no-such-user/no-such-tokenizer", env={"HF_HUB_OFFLINE": "1"})
    assert code == 2 and "--tokenizer byte" in one_line_error(err)
    # a hang guard, far above the ~5-20 s of start-up: offline, the Hub client must not retry for minutes
    assert time.monotonic() - t0 < 120


def test_untrained_sample_is_printable():
    """Random bytes (what an untrained model writes) come out as \\xNN escapes, not raw control bytes."""
    ids = list(range(256))
    text = data.printable(data.ByteTokenizer(), ids)
    assert all(c.isprintable() or c in "\n\t" for c in text)
    assert "\\x1b" in text and "\\xff" in text and "ABC" in text
    assert data.printable(data.ByteTokenizer(), list("héllo\n".encode())) == "héllo\n"


# ------------------------------------------------------------------------------------- resume
def _run(out, **kw):
    cfg = Config(**{**dict(steps=4, save_every=2, out=str(out), seq_len=32, micro_batch_size=4, eval_every=0,
                           sample_tokens=0, log_every=100), **kw})
    with Mesh.init() as mesh:
        train_mod.train(cfg, mesh)


def test_resume_into_another_model_names_the_field(tmp_path):
    _run(tmp_path)
    msg = error_of(out=str(tmp_path), resume=True, steps=8, hidden_size=256)
    assert msg.startswith(f"checkpoint {tmp_path}/checkpoints/step_000004 holds a model with hidden_size=128, "
                          f"but this run asks for hidden_size=256 (a model flag given now: --resume reuses the run's "
                          f"own settings); drop that flag to continue --out {tmp_path}, or pass --out runs/main")
    assert "num_key_value_heads" in error_of(out=str(tmp_path), resume=True, steps=8, num_key_value_heads=2)
    assert "nothing to do" in error_of(out=str(tmp_path), resume=True, steps=4)
    validate(Config(out=str(tmp_path), resume=True, steps=8), 1)  # the same model resumes


def test_resume_into_another_layout_is_accepted(tmp_path):
    """Checkpoints reshard (tests/test_checkpoint.py): another layout is no reason to refuse --resume."""
    _run(tmp_path)
    validate(Config(out=str(tmp_path), resume=True, steps=8, dp=2), 2)


# ------------------------------------------------------------------------------------- Ctrl-C
def _interrupt_after_first_step(args, out):
    """Start a long run, press Ctrl-C (SIGINT) once its first progress line appears; return (code, out, err)."""
    proc = subprocess.Popen([sys.executable, "-m", "picotron.train", "--steps", "100000", "--log-every", "1",
                             "--out", str(out), *QUICK, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=ENV, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step "):
                os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground process group
                break
        out_rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, "".join(lines) + out_rest, err


def _check_interrupted(code, err, out_dir):
    assert code == 130 and "Traceback" not in err, err
    final = [line for line in err.strip().splitlines() if not line.startswith("picotron: Ctrl-C")]
    assert len(final) == 1 and final[0].startswith("picotron: stopped: interrupted after step "), err
    assert final[0] == err.strip().splitlines()[-1]  # the last thing shown
    step = int(final[0].split("interrupted after step ")[1].split("/")[0])
    folder = checkpoint.latest(str(out_dir))
    assert folder.endswith(f"step_{step:06d}") and folder in final[0] and "--resume" in final[0]
    return step


def test_ctrl_c_saves_a_checkpoint_says_one_line_and_resumes(tmp_path):
    code, out, err = _interrupt_after_first_step([], tmp_path)
    step = _check_interrupted(code, err, tmp_path)
    code, out, err = picotron("--steps", step + 2, "--resume", "--out", tmp_path, *QUICK)
    assert code == 0, err
    assert f"resuming from {tmp_path}/checkpoints/step_{step:06d} at step {step + 1}" in out
    steps, summary = read_metrics(str(tmp_path))
    assert [r["step"] for r in steps] == list(range(1, step + 3)) and summary is not None


def test_ctrl_c_on_two_processes_stops_every_rank_after_the_same_step(tmp_path):
    """`python -m picotron.train --dp 2` starts torchrun itself; Ctrl-C reaches the workers through it."""
    code, out, err = _interrupt_after_first_step(["--dp", "2"], tmp_path)
    _check_interrupted(code, err, tmp_path)
    assert "ChildFailedError" not in out + err and "Traceback" not in out


# ------------------------------------------------------------------------------------- launching
def test_bad_setting_for_several_processes_is_refused_before_any_starts():
    code, out, err = picotron("--dp", "2", "--tp", "3")
    assert code == 2 and out == "" and "tp=3 does not divide" in one_line_error(err)


def test_several_processes_without_torchrun(tmp_path):
    code, out, err = picotron("--dp", "2", "--steps", "2", "--out", tmp_path, *QUICK)
    assert code == 0, err
    assert "grid dp=2" in out and "data parallel" in out
    assert [r["step"] for r in read_metrics(str(tmp_path))[0]] == [1, 2]


FAKE_GPUS = """import torch  # this test's stand-in for a CUDA machine: torch sees {n} GPU(s), nothing else changes
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: {n}
"""


def test_two_processes_on_one_gpu_is_one_sentence_before_torchrun_starts(tmp_path):
    """`./run.sh --dp 2` (= python -m picotron.train --dp 2) on a one-GPU machine ran on the CPU without a word;
    now it names --device cpu before any process starts. (torch.cuda is faked in the child: no GPU here.)"""
    (tmp_path / "sitecustomize.py").write_text(FAKE_GPUS.format(n=1))
    code, out, err = picotron("--dp", "2", "--steps", "2", env={"PYTHONPATH": f"{tmp_path}:{ROOT}"}, timeout=120)
    assert code == 2 and out == ""  # no torchrun, no worker
    assert one_line_error(err) == ("picotron: error: 2 processes per node need 2 GPUs (one each); this node has 1: pass "
                                   "--device cpu to run them on CPU with gloo, or run at most 1 process per node.")
    code, out, err = picotron("--dp", "2", "--device", "cuda", env={"PYTHONPATH": f"{tmp_path}:{ROOT}"}, timeout=120)
    assert code == 2 and "--device cuda with 2 processes per node needs 2 GPUs" in one_line_error(err)


def _node(cwd, node_rank, port, *args):
    """One "machine" of a two-node job on this one: its own folder (not shared), the launcher as a user runs it."""
    os.makedirs(cwd, exist_ok=True)
    cmd = [sys.executable, "-m", "picotron.train", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--steps", "3", "--timeout-s", "300", *QUICK, *map(str, args)]
    if node_rank is not None:
        cmd += ["--node-rank", str(node_rank)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=ENV,
                            start_new_session=True)


def _finish(*procs, timeout=240):
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, *o) for p, o in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.heavy  # the heavy tier: test_checkpoint's agreed resume covers the check by default
def test_two_nodes_resume_only_from_a_folder_both_see(tmp_path):
    """Two launchers on this machine play two nodes (torchrun's static rendezvous, --node-rank), each in its own
    folder, --out relative: node 0 has a checkpoint, node 1 does not see it. Rank 0 picks it, rank 1 says it does
    not see it, and both nodes end with that sentence (no hang); tp = 2 across the nodes is warned about."""
    from picotron.launch import _free_port

    ckpt = tmp_path / "node0" / "runs" / "x" / "checkpoints" / "step_000002"
    os.makedirs(ckpt)
    (ckpt / "config.json").write_text(json.dumps(Config(tp=2, seq_len=32, micro_batch_size=4).to_dict()))
    (ckpt.parent / "latest").write_text("step_000002")
    port = _free_port()
    nodes = [_node(tmp_path / f"node{r}", r, port, "--tp", 2, "--out", "runs/x", "--resume") for r in (0, 1)]
    (code0, out0, err0), (code1, out1, err1) = _finish(*nodes)
    sentence = ("picotron: error: rank 1 does not see runs/x/checkpoints/step_000002 that rank 0 resumes from: every "
                "node must see the same checkpoint folder (a shared filesystem), or copy it there.")
    assert (code0, code1) == (2, 2), err0 + err1
    assert err0.strip().splitlines()[-1] == sentence and err1.strip().splitlines()[-1] == sentence, err0 + err1
    assert ("picotron: warning: tp = 2 spans 2 nodes of 1 process: their per-layer traffic would cross the network; "
            "keep tp <= 1.") in out0
    assert "Traceback" not in out0 + err0 + out1 + err1


def test_two_nodes_train_together(tmp_path):
    """The same two "nodes", torchrun's c10d rendezvous (no --node-rank), one shared --out: they train as dp = 2."""
    from picotron.launch import _free_port

    port, out = _free_port(), tmp_path / "shared"
    nodes = [_node(tmp_path / f"node{r}", None, port, "--dp", 2, "--out", out, "--save-every", 3) for r in (0, 1)]
    results = _finish(*nodes)
    assert [r[0] for r in results] == [0, 0], "\n".join(r[2][-2000:] for r in results)
    steps, summary = read_metrics(str(out))
    assert [r["step"] for r in steps] == [1, 2, 3] and summary["world_size"] == 2
    assert checkpoint.latest(str(out)).endswith("step_000003")
    assert "warning" not in "".join(r[1] for r in results)  # dp across nodes is what it is for


# ------------------------------------------------------------------------------------- inconsistent rules
def test_ep_without_experts_says_how_to_get_them():
    msg = error_of(dp=2, ep=2)
    assert msg.startswith("ep=2 needs a model with experts") and "--preset tiny-moe" in msg


def test_zero_needs_data_parallel_ranks():
    msg = error_of(zero=3)
    assert msg.startswith("zero=3 with dp=1 has nothing to shard over") and "--dp 2" in msg


def test_start_up_line_names_the_strategies_and_warns_of_a_long_warm_up(tmp_path):
    code, out, err = picotron("--steps", "2", "--out", tmp_path, *QUICK[:-2], "--warmup-steps", "500")
    assert code == 0, err
    assert "| one process |" in out and f"writes {tmp_path}" in out
    assert "warmup_steps=500 > steps=2, so the learning rate never reaches lr=0.003" in out


def test_help_is_a_reference():
    proc = subprocess.run([sys.executable, "-m", "picotron.train", "--help"], capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=60)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0
    for field in config._field_types():
        assert f"--{field.replace('_', '-')}" in text, field
    assert "one of fp32, bf16" in text and "one of 0, 1, 2, 3" in text and "one of naive, overlap, bucket, ddp" in text
    assert "one of none, selective, full" in text and "0 = no clipping" in text
    assert "all-to-all" in text and "--top-k" in text and "--pp-schedule" in text and "--cp-impl" in text and "any mix" not in text


# ------------------------------------------------------------------------------------- run.sh
FAKE_PY = """#!/usr/bin/env bash
# A stand-in Python for run.sh's decisions: logs every call, answers the few questions run.sh asks.
echo "$0 $*" >> "{log}"
case "$*" in
  *"sys.prefix == sys.base_prefix"*) exit {in_env} ;;  # in_env
  *"print(sys.executable)"*|*"print(sys.prefix)"*) echo "$0"; exit 0 ;;
  "-c import torch") [ -e "$(dirname "$0")/torch" ] && exit 0 || exit 1 ;;
  *"find_spec"*) exit 0 ;;  # set up: torch and picotron are findable
  "-m venv"*) mkdir -p .venv/bin && sed -e 's/exit 1 ;;  # in_env/exit 0 ;;/' "$0" > .venv/bin/python
              chmod +x .venv/bin/python
              case "$*" in *--system-site-packages*) touch .venv/bin/torch ;; esac; exit 0 ;;
  *"pip install"*"torch=="*) touch "$(dirname "$0")/torch"; exit 0 ;;
  "-m picotron.train"*) echo "launcher=$PICOTRON_LAUNCHER defaults=$PICOTRON_LAUNCHER_DEFAULTS" >> "{log}"
                        shift 2; while [ $# -gt 0 ]; do [ "$1" = --out ] && mkdir -p "$2"; shift; done; exit 0 ;;
esac
exit 0
"""


def _fake_checkout(tmp_path, has_torch):
    """run.sh, its requirement files and a fake base Python that is not a virtualenv."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("run.sh", "requirements.txt", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), repo / name)
    log = tmp_path / "calls.log"
    base = tmp_path / "python3"
    base.write_text(FAKE_PY.format(log=log, in_env=1))  # sys.exit(True): not a virtualenv
    base.chmod(0o755)
    if has_torch:
        (tmp_path / "torch").touch()  # the base Python has a torch (a GPU pod's CUDA build)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    env["PYTHON"] = str(base)
    return repo, log, env


def _run_sh(repo, env, *args):
    proc = subprocess.run(["bash", "run.sh", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("has_torch", [False, True])
def test_run_sh_makes_a_project_environment_and_never_installs_into_the_base_python(tmp_path, has_torch):
    repo, log, env = _fake_checkout(tmp_path, has_torch)
    first = _run_sh(repo, env, "setup")
    calls = log.read_text().splitlines()
    base, venv = env["PYTHON"], str(repo / ".venv/bin/python")
    assert "making a project-local environment in .venv/" in first
    venv_call = [c for c in calls if " -m venv" in c]
    assert venv_call == [f"{base} -m venv {'--system-site-packages ' if has_torch else ''}.venv"]
    assert not any(c.startswith(base) and "pip" in c for c in calls)  # nothing installed into the base Python
    pips = [c for c in calls if c.startswith(venv) and " -m pip install" in c]
    assert any("-r requirements.txt" in c for c in pips) and any("-e ." in c for c in pips)
    assert any("torch==2.13.0" in c for c in pips) == (not has_torch)  # a pod's CUDA torch is reused
    log.write_text("")
    second = _run_sh(repo, env, "setup")  # the second time: nothing to do
    assert "set-up" not in second and not any(" -m pip" in c or " -m venv" in c for c in log.read_text().splitlines())
    assert not any("import torch" in c for c in log.read_text().splitlines())  # checked without importing torch


def test_run_sh_uses_an_active_environment(tmp_path):
    repo, log, env = _fake_checkout(tmp_path, has_torch=True)
    env["VIRTUAL_ENV"] = str(tmp_path)
    out = _run_sh(repo, env, "setup")
    assert not (repo / ".venv").exists() and "making a project-local environment" not in out
    assert any(c.startswith(env["PYTHON"]) and "-r requirements.txt" in c for c in log.read_text().splitlines())


def test_run_sh_is_the_main_job_with_its_defaults_and_leaves_the_folder_to_it(tmp_path):
    """./run.sh ARGS is `python -m picotron.train ARGS` with run.sh's defaults (--steps 600 --eval-every 100
    --save-every 100) and its name beside the flags, not among them, so the commands picotron hands back are what the
    user typed (issue 41); the folder (a new runs/main-N, --out, --resume) is picotron.runs' business, so ./run.sh and
    python -m behave the same (tests/test_runs.py runs the real thing)."""
    repo, log, env = _fake_checkout(tmp_path, has_torch=True)
    _run_sh(repo, env, "setup")
    for args in ([], ["--resume"], ["--out", "runs/mine"], ["--dp", "16", "--nnodes", "2", "--rdzv-endpoint", "n0:29500"]):
        _run_sh(repo, env, *args)
        call, said = log.read_text().splitlines()[-2:]
        assert call.endswith(" ".join(["-m picotron.train", *args]).rstrip())
        assert said == "launcher=./run.sh defaults=--steps 600 --eval-every 100 --save-every 100"
