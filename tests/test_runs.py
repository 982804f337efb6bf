"""Run folders (picotron.runs): no run's results are ever replaced, the main job keeps its model, and what the
job tells the user to do next works and cannot loop. Real runs of `./run.sh` / `python -m picotron.train`, each
in a scratch folder of its own."""
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from picotron import runs
from picotron.config import Config
from picotron.messages import divergence_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
TINY = ["--seq-len", "32", "--micro-batch-size", "2", "--eval-every", "0", "--sample-tokens", "0",
        "--warmup-steps", "0", "--log-every", "100"]


def _run_sh_here(tmp_path):
    """A copy of run.sh in tmp_path that uses this Python (an active environment, already set up), so the runs it
    starts write tmp_path/runs, not the repository's."""
    for name in ("run.sh", "requirements.txt", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    stamp = subprocess.run("cat requirements.txt pyproject.toml | cksum", shell=True, cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout.strip()
    (tmp_path / ".setup-stamp").write_text(f"{stamp} {sys.executable}\n")
    return {**ENV, "PYTHON": sys.executable, "VIRTUAL_ENV": sys.prefix}


def run_sh(tmp_path, env, *args):
    proc = subprocess.run(["bash", "run.sh", *map(str, args)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def files(folder):
    """Every file under folder -> its sha256."""
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def one_sentence(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("picotron: error: ") and "Traceback" not in err, err
    return lines[0]


def test_run_sh_then_resume_then_another_run_never_replace_a_file(tmp_path):
    env = _run_sh_here(tmp_path)
    code, out, err = run_sh(tmp_path, env, "--steps", 3, *TINY)
    assert code == 0, err
    assert "== this run writes runs/main/ (earlier runs are kept; --out DIR to choose)" in out
    first = files(tmp_path / "runs/main")
    assert "checkpoints/step_000003/rank_00000.pt" in first  # the main job keeps its model (the last step's)
    metrics = (tmp_path / "runs/main/metrics.jsonl").read_text()

    code, out, err = run_sh(tmp_path, env, "--resume", "--steps", 5, *TINY)  # continues runs/main, in place
    assert code == 0, err
    assert "== this run continues runs/main/ from its checkpoint at step 3" in out and "resuming from" in out
    assert (tmp_path / "runs/main/metrics.jsonl").read_text().startswith(metrics.split('{"summary"')[0])
    after = files(tmp_path / "runs/main")
    assert all(after[k] == v for k, v in first.items() if "step_000003" in k or k == "run.json")
    assert "checkpoints/step_000005/rank_00000.pt" in after

    code, out, err = run_sh(tmp_path, env, "--steps", 3, *TINY)  # a new run: a new folder
    assert code == 0, err
    assert "== this run writes runs/main-2/" in out
    assert files(tmp_path / "runs/main") == after


def test_out_at_an_existing_run_and_resume_without_a_checkpoint_are_refused(tmp_path):
    env = _run_sh_here(tmp_path)
    assert run_sh(tmp_path, env, "--steps", 2, "--no-save-final", *TINY)[0] == 0  # a run that kept no checkpoint
    assert run_sh(tmp_path, env, "--steps", 2, *TINY)[0] == 0  # runs/main-2, with one
    before = files(tmp_path / "runs")
    code, out, err = run_sh(tmp_path, env, "--out", "runs/main", "--steps", 2, "--dp", 2, *TINY)
    assert code == 2 and one_sentence(err) == (
        "picotron: error: --out runs/main already holds a run (metrics of steps 1-2 and no checkpoint) and a new run "
        "would replace its results; continue it with --resume, or pass a new --out (or none: a new runs/main-N).")
    code, out, err = run_sh(tmp_path, env, "--resume", "--out", "runs/main", "--steps", 4, *TINY)
    assert code == 2 and one_sentence(err) == (
        "picotron: error: --resume needs a checkpoint, but runs/main holds metrics of steps 1-2 and no checkpoint; "
        "continue another run with --resume --out runs/main-2 (it has metrics of steps 1-2 and a checkpoint at step "
        "2), or start a new run without --resume (runs keep a checkpoint every --save-every steps and at their last "
        "step).")
    code, out, err = run_sh(tmp_path, env, "--resume", "--out", "runs/nothing", *TINY)
    assert code == 2 and "runs/nothing holds no run" in one_sentence(err)
    code, out, err = run_sh(tmp_path, env, "--tp", 3, *TINY)  # a refused configuration claims no folder
    assert code == 2 and "this run writes" not in out and not (tmp_path / "runs/main-3").exists()
    assert files(tmp_path / "runs") == before


def test_resume_from_an_older_checkpoint_is_a_new_run(tmp_path):
    env = _run_sh_here(tmp_path)
    assert run_sh(tmp_path, env, "--steps", 4, "--save-every", 2, *TINY)[0] == 0
    before = files(tmp_path / "runs/main")
    code, out, err = run_sh(tmp_path, env, "--resume-from", "runs/main/checkpoints/step_000002", "--steps", 4, *TINY)
    assert code == 0, err
    assert ("== this run writes runs/main-2/, a new run from runs/main/checkpoints/step_000002 (that run is kept as "
            "it was; --out DIR to choose)") in out
    assert files(tmp_path / "runs/main") == before
    old = [json.loads(x) for x in (tmp_path / "runs/main/metrics.jsonl").read_text().splitlines()]
    new = [json.loads(x) for x in (tmp_path / "runs/main-2/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in new if "step" in r] == [3, 4]
    assert [r["loss"] for r in new if "step" in r] == [r["loss"] for r in old if r.get("step") in (3, 4)]  # exact
    code, out, err = run_sh(tmp_path, env, "--resume", "--resume-from", "runs/main", *TINY)
    assert code == 2 and "pass one of them" in one_sentence(err)


def test_two_runs_started_together_claim_different_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got, cfg = [], Config()
    threads = [threading.Thread(target=lambda: got.append(runs.prepare(cfg, [])[0])) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got, key=lambda p: int(p.rsplit("-", 1)[1]) if "-" in p else 1) == \
        ["runs/main"] + [f"runs/main-{n}" for n in range(2, 9)]
    assert all(os.path.exists(os.path.join(p, "run.json")) for p in got)


def test_several_nodes_and_torchrun_must_name_one_folder(tmp_path):
    with pytest.raises(runs.RunFolderError, match="several nodes"):
        runs.prepare(Config(dp=16, nnodes=2, rdzv_endpoint="n0:29500"), [])
    proc = subprocess.run([sys.executable, "-m", "picotron.train", "--dp", "2", *TINY], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={**ENV, "WORLD_SIZE": "2", "RANK": "0"})
    assert proc.returncode == 2 and "under torchrun the 2 processes must write one folder" in one_sentence(proc.stderr)


@pytest.mark.heavy  # the heavy tier: tests/test_hf_files.py exports and loads by default
def test_the_main_jobs_model_exports_and_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from picotron.model import Llama

    env = _run_sh_here(tmp_path)
    assert run_sh(tmp_path, env, "--steps", 3, *TINY)[0] == 0
    proc = subprocess.run([sys.executable, "-m", "picotron.export", "runs/main", "hf"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = Llama.from_hf(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ advice that cannot loop
def test_divergence_advice_fits_the_settings_in_force(monkeypatch):
    monkeypatch.delenv("PICOTRON_LAUNCHER", raising=False)
    monkeypatch.setattr(runs, "launcher", lambda: "python -m picotron.train")  # (which python: the next tests)
    argv = ["--steps", "9", "--lr", "0.003"]
    at_one = divergence_message(Config(out="r", grad_clip=1.0, warmup_steps=20), 50, float("nan"), float("nan"),
                                False, "r/checkpoints/step_000040", argv)
    assert "clip" not in at_one  # already clipping at 1: no "clip harder"
    assert "lower --lr (now 0.003; e.g. 0.001)" in at_one
    assert at_one.endswith("continue with python -m picotron.train --steps 9 --lr 0.001 --resume --out r.")
    assert "clip harder (--grad-clip 1; now 5)" in divergence_message(Config(out="r", grad_clip=5.0), 50, 1e30,
                                                                      float("inf"), False, None, argv)
    none = divergence_message(Config(out="r", grad_clip=0.0), 50, 1e30, float("inf"), False, None, argv)
    assert "clip the gradient norm (--grad-clip 1)" in none and "no checkpoint was saved" in none
    assert "--resume" not in none.split("start again with")[1]


def test_the_resume_command_after_an_injected_nan_runs_to_the_end(tmp_path):
    """--faults nan@3 stops the run; the message's command (without --faults) resumes and finishes instead of
    stopping at step 3 again."""
    args = ["--steps", "4", "--save-every", "1", "--out", "r", "--faults", "nan@3", *TINY]
    proc = subprocess.run([sys.executable, "-m", "picotron.train", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=ENV)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "that NaN was injected by --faults nan@3" in last, proc.stderr
    command = last.split("continue with ", 1)[1].rstrip(".")
    assert "--faults" not in command and command.endswith("--resume --out r")
    python, *rest = shlex.split(command)  # this Python, as the shell finds it (outside .venv `python` may be another)
    assert python in ("python", "python3", sys.executable) and rest[:2] == ["-m", "picotron.train"]
    proc = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr  # pasted as printed
    assert "resuming from r/checkpoints/step_000002 at step 3" in proc.stdout


def no_flag_twice(command):
    flags = [t.split("=")[0].replace("--no-", "--") for t in shlex.split(command) if t.startswith("--")]
    assert len(flags) == len(set(flags)), command


def test_the_hint_after_ctrl_c_is_the_command_typed_with_each_flag_once(monkeypatch):
    """Issue 41: after Ctrl-C under ./run.sh it said `continue with python -m picotron.train --steps 600
    --eval-every 100 --save-every 100 --steps 1200 --resume --out runs/main`: run.sh's defaults, a flag twice, and a
    `python` that outside .venv has no torch."""
    from picotron.messages import resume_hint

    monkeypatch.setenv("PICOTRON_LAUNCHER", "./run.sh")
    typed = ["--steps", "1200", "--resume", "--out", "runs/main"]  # (the workers' argv: the folder appended)
    hint = resume_hint(Config(out="runs/main"), "runs/main/checkpoints/step_000700", typed)
    assert hint.endswith("continue with ./run.sh --steps 1200 --resume --out runs/main")
    assert runs.command(["--steps", "5", "--lr", "0.5", "--steps", "7", "--no-sp", "--faults", "nan@3"], add=["--lr", "0.1"],
                        drop=("faults",)) == "./run.sh --steps 7 --no-sp --lr 0.1"


def test_a_stop_under_run_sh_hands_back_a_run_sh_command_that_finishes(tmp_path):
    """The NaN stop's hint under ./run.sh: ./run.sh, the flags typed (none of run.sh's defaults), each once; pasted
    into a shell it resumes and finishes."""
    env = _run_sh_here(tmp_path)
    code, out, err = run_sh(tmp_path, env, "--steps", 4, "--save-every", 1, "--faults", "nan@3", *TINY)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "that NaN was injected" in last, err
    command = last.split("continue with ", 1)[1].rstrip(".")
    assert command == shlex.join(["./run.sh", "--steps", "4", "--save-every", "1", *TINY, "--resume", "--out",
                                  "runs/main"])
    no_flag_twice(command)
    proc = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "resuming from runs/main/checkpoints/step_000002 at step 3" in proc.stdout, proc.stderr


def test_resume_continues_the_run_the_flags_name_with_its_own_settings(tmp_path):
    """Issue 41: after runs of other models, `--resume` took the newest run (another model) and refused; and it
    needed the run's settings typed again."""
    env = _run_sh_here(tmp_path)
    assert run_sh(tmp_path, env, "--steps", 2, *TINY)[0] == 0  # runs/main
    assert run_sh(tmp_path, env, "--steps", 2, "--intermediate-size", 96, *TINY)[0] == 0  # runs/main-2: another model
    code, out, err = run_sh(tmp_path, env, "--resume", "--steps", 3, *TINY)  # the flags of runs/main, not the newest
    assert code == 0 and "== this run continues runs/main/ from its checkpoint at step 2" in out, err
    code, out, err = run_sh(tmp_path, env, "--resume", "--steps", 4, "--log-every", 1)  # flags of neither: which?
    assert code == 2 and one_sentence(err) == (
        "picotron: error: --resume without --out: 2 runs have a checkpoint and none was started with the flags given "
        "now (no flags), so it cannot tell which to continue; add the --out of the one you mean: --out runs/main-2 "
        "(started with --intermediate-size 96 --seq-len 32 --micro-batch-size 2 --warmup-steps 0, checkpoint at step "
        "2), --out runs/main (started with --seq-len 32 --micro-batch-size 2 --warmup-steps 0, checkpoint at step 3).")
    code, out, err = run_sh(tmp_path, env, "--resume", "--out", "runs/main", "--steps", 4)  # its settings, not retyped
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "runs/main/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3, 4] and rows[-2]["tokens"] == 4 * 2 * 32  # seq 32
    code, out, err = run_sh(tmp_path, env, "--resume", "--out", "runs/main-2", "--steps", 4, "--intermediate-size", 64)
    assert code == 2 and one_sentence(err) == (
        "picotron: error: checkpoint runs/main-2/checkpoints/step_000002 holds a model with intermediate_size=96, but "
        "this run asks for intermediate_size=64 (a model flag given now: --resume reuses the run's own settings); drop "
        "that flag to continue --out runs/main-2, or pass --out runs/main-3 without --resume to start a new run with "
        "this model.")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["--steps", "0"], ["--resume"], ["--out", "r", "--resume"]])
def test_help_and_refusals_answer_before_torch_is_imported(tmp_path, args):
    """Issue 41: every command imported torch (40-106 s on a busy machine) before --help or a one-sentence
    refusal."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "picotron.train", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=ENV)
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")]
    assert "picotron.config" in imported and "torch" not in imported, proc.stderr[-2000:]
    assert proc.returncode == (0 if args[0] in ("--help", "--version") else 2), proc.stderr[-2000:]


@pytest.mark.parametrize("args, sentence", [
    (["--tp", "3"], "tp=3 does not divide num_attention_heads=8; pick tp in {1, 2, 4}."),  # the README's example
    (["--cp", "3"], "cp=3 needs seq_len=128 divisible by 2*cp=6"),
    (["--pp", "9"], "pp=9 with 1 chunk per rank needs 9 stages of at least one layer each"),
    (["--dp", "2", "--zero", "1", "--dp-impl", "naive"], "dp_impl='naive' does not apply with zero=1"),  # combination
    (["--data", "small.txt"], "data 'small.txt' holds 12 tokens, too few for seq_len=128"),  # a local file, read
])
def test_strategy_rules_refuse_before_torch_is_imported(tmp_path, args, sentence):
    """Issue 41: the strategies' rules (picotron.rules), the combination table and the data's answer in one sentence
    without importing torch (seconds, a minute on a busy machine), as config.check's do."""
    (tmp_path / "small.txt").write_text("hello world\n")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "picotron.train", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=ENV)
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")]
    assert "picotron.rules" in imported and "torch" not in imported, proc.stderr[-2000:]
    err = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time"))
    assert proc.returncode == 2 and one_sentence(err).startswith(f"picotron: error: {sentence}"), err


def test_config_out_none_is_for_the_command_line_only(tmp_path):
    from picotron.mesh import Mesh
    from picotron.train import train

    with Mesh.init() as mesh, pytest.raises(ValueError, match="cfg.out is None"):
        train(replace(Config(), steps=1), mesh)
