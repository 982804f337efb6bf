"""Lesson 01: the memory planner against measurement, the exercise checker, and the notebook end to end.

Tolerances: parameters, gradients and optimizer state must match `planner.memory_estimate` exactly; the
activation bytes counted by the saved-tensor hook match it exactly on torch 2.13 (CPU), and we allow 0.1% so
that a kernel saving one more small tensor (e.g. an RNG seed on another version) does not fail the suite.
"""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from picotron import data, metrics, planner
from picotron.config import Config
from picotron.mesh import Mesh
from picotron.model import ModelConfig
from picotron.parallelize import parallelize

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "lessons" / "01_single_device" / "check.py"
ACTIVATION_RTOL = 1e-3


def one_step(cfg):
    """One real training step of the trainer's own pieces on one device; returns the measured memory by category."""
    run = parallelize(cfg, Mesh.local())  # one process, no process group: model, AdamW, step engine, loss
    tokens = data.TokenData(data.ByteTokenizer().encode_tensor(data.load_text("shakespeare")[:200_000]))
    batches = data.DataLoader(tokens, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size).micro_batches(1)
    run.schedule.run(run.model, batches, run.loss_fn)  # forward + backward (bf16 autocast if cfg.dtype says so)
    run.optimizer.step()
    return {**run.model.memory(), "optimizer": metrics.optimizer_bytes(run.optimizer),
            "activations": run.schedule.activation_bytes}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_planner_matches_measurement(dtype, attn_impl, recompute):
    cfg = Config(preset="tiny", num_hidden_layers=2, seq_len=48, micro_batch_size=3, dtype=dtype,
                 recompute=recompute, attn_impl=attn_impl)
    measured = one_step(cfg)
    planned = planner.memory_estimate(cfg.model_config(), cfg.seq_len, cfg.micro_batch_size, dtype, recompute)
    for part in ("params", "grads", "optimizer"):
        assert measured[part] == planned[part], (part, measured[part], planned[part])
    assert abs(measured["activations"] - planned["activations"]) <= ACTIVATION_RTOL * planned["activations"], \
        (measured["activations"], planned["activations"])
    assert planned["total"] == sum(planned[p] for p in ("params", "grads", "optimizer", "activations"))


@pytest.mark.parametrize("tied,kv_heads", [(True, 4), (False, 8)])
def test_planner_tied_and_mha(tied, kv_heads):
    cfg = Config(preset="tiny", num_hidden_layers=1, seq_len=32, micro_batch_size=2, num_key_value_heads=kv_heads)
    mc = dataclasses.replace(cfg.model_config(), tie_word_embeddings=tied)
    cfg.model_config = lambda: mc  # this Config's model is exactly mc (no Config field unties the embedding)
    measured = one_step(cfg)
    planned = planner.memory_estimate(mc, 32, 2)
    assert {p: measured[p] for p in ("params", "grads", "optimizer")} == \
        {p: planned[p] for p in ("params", "grads", "optimizer")}
    assert abs(measured["activations"] - planned["activations"]) <= ACTIVATION_RTOL * planned["activations"]


def test_textbook_formulas():
    n = 10**9
    assert sum(planner.model_state_bytes(n, "fp32").values()) == 16 * n
    assert sum(planner.model_state_bytes(n, "bf16").values()) == 16 * n  # 2 + 2 + 4 master + 8 moments
    s, b, h, a = 2048, 1, 4096, 32
    assert planner.korthikanti_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    assert planner.korthikanti_bytes_per_layer(s, b, h, a, "selective") == 34 * s * b * h
    assert planner.korthikanti_bytes_per_layer(s, b, h, a, "full") == 2 * s * b * h
    mc = ModelConfig.from_preset("llama3-8b")
    assert planner.memory_estimate(mc, 2048, 1)["params"] == 4 * mc.num_params()
    with pytest.raises(ValueError, match="recompute"):
        planner.memory_estimate(mc, 2048, 1, recompute="some")


# ------------------------------------------------------------------------------------- the checker
def run_checker(*args):
    proc = subprocess.run([sys.executable, str(CHECKER), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stdout + proc.stderr


def test_checker_passes_the_solutions():
    code, out = run_checker("--solutions")
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out


def test_checker_fails_the_stubs_naming_not_implemented():
    code, out = run_checker()
    assert code == 1, out
    for name in ("count_parameters", "model_state_bytes", "activation_bytes_per_layer", "accumulate_gradients"):
        assert f"FAIL  {name}(" in out, out
    assert "NotImplementedError: not written yet" in out


WRONG = '''
import torch.nn.functional as F

def count_parameters(cfg):  # counts lm_head even when it is tied to the embedding
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h
    return 2 * cfg.vocab_size * h + cfg.num_hidden_layers * layer + h

def accumulate_gradients(model, input_ids, targets, k):  # forgets to divide by k
    total = 0.0
    for x, y in zip(input_ids.chunk(k), targets.chunk(k)):
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        total += loss.item() / k
    return total
'''


def test_checker_reports_wrong_values(tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text(WRONG)
    code, out = run_checker("--module", str(wrong), "count_parameters", "accumulate_gradients")
    assert code == 1, out
    assert "count_parameters(smollm-135m): got 162,826,560, expected 134,515,008" in out, out
    assert "did you count lm_head although tie_word_embeddings=True?" in out
    assert "ok    count_parameters(tiny) = 853,120" in out  # untied: the same function is right
    assert "the gradients are 4.00× the reference: divide each micro-batch's loss by k" in out, out


# ------------------------------------------------------------------------------------- the notebook
def test_notebook_runs_in_fast_mode(run_notebook):
    text = run_notebook("01_single_device")
    assert "✗" not in text, text
    assert text.count("✓") >= 7
