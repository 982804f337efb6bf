"""Lesson 01: the memory planner against the counted tensors, the allocator's view of a step (torch.profiler),
the exercise checker (the puzzle included), and the notebook end to end.

Tolerances: parameters, gradients and optimizer state must match `planner.memory_estimate` exactly; the
activation bytes counted by the saved-tensor hook match it exactly on torch 2.13 (CPU), and we allow 0.1% so
that a kernel saving one more small tensor (e.g. an RNG seed on another version) does not fail the suite. The
allocator's levels at the phase boundaries must match the counts within 1% (the token ids, allocated before the
step, and checkpoint's saved RNG state make the small difference).
"""
import dataclasses
import sys
from pathlib import Path

import pytest
from _lessons import checker
import torch

from picotron import data, metrics, planner
from picotron.config import Config
from picotron.mesh import Mesh
from picotron.model import ModelConfig
from picotron.parallelize import parallelize

ROOT = Path(__file__).resolve().parents[1]
LESSON = ROOT / "lessons" / "01_single_device"
ACTIVATION_RTOL = 1e-3
sys.path.insert(0, str(LESSON))  # the lesson's experiment.py and check.py


def one_step(cfg):
    """One real training step of the trainer's own pieces on one device; returns the measured memory by category."""
    run = parallelize(cfg, Mesh.local())  # one process, no process group: model, AdamW, step engine, loss
    tokens = data.TokenData(data.ByteTokenizer().encode_tensor(data.load_text("shakespeare")[:200_000]))
    batches = data.DataLoader(tokens, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size).micro_batches(1)
    activations = run.schedule.phases.listen(metrics.ActivationPeak(run.model))  # as the trainer counts them
    run.schedule.run(run.model, batches, run.loss_fn)  # forward + backward (bf16 autocast if cfg.dtype says so)
    run.optimizer.step()
    return {**run.model.memory(), "optimizer": metrics.optimizer_bytes(run.optimizer),
            "activations": activations.bytes}


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


# ---------------------------------------------------------------------- the allocator and the trace
@pytest.mark.parametrize("recompute,grad_acc", [("none", 1), ("full", 1), ("none", 2)])
def test_allocator_matches_the_counts(recompute, grad_acc):
    import experiment as lesson

    cfg = lesson.make_cfg("tiny", num_hidden_layers=2, seq_len=64, micro_batch_size=4 // grad_acc, grad_acc=grad_acc,
                          recompute=recompute)
    r = lesson.step_memory(cfg, torch.device("cpu"))
    c = r["counted"]
    assert r["after_build"] == pytest.approx(c["params"], rel=0.01)
    for s in r["steps"]:
        assert s["after_forward"] - s["start"] == pytest.approx(c["activations"], rel=0.01)
        assert s["before_optimizer"] - s["start"] == pytest.approx(c["grads"], rel=0.01)
    first, last = r["steps"]
    assert first["end"] - first["start"] == pytest.approx(c["optimizer"], rel=0.01)  # AdamW's state, created at step 1
    assert last["end"] == last["start"]
    mc = cfg.model_config()
    assert c["params"] + c["optimizer"] + c["activations"] <= last["peak"] <= lesson.peak_bound(mc, 64, 4 // grad_acc,
                                                                                               "fp32", recompute)


def test_trace_is_written_and_self_times_add_up(tmp_path):
    import json

    import experiment as lesson

    result = lesson.exp_trace(Mesh.local(), fast=True, out=tmp_path)
    events = json.loads((tmp_path / "trace_step.json").read_text())["traceEvents"]
    assert {"forward", "backward", "optimizer"} <= {e.get("name") for e in events}
    for name, p in result["phases"].items():  # on a CPU the phase's self times (gaps included) are its wall time
        assert p["self_ms"] == pytest.approx(p["wall_ms"], rel=0.01), name
        assert sum(ms for _, ms in p["top"]) + p["other_ms"] == pytest.approx(p["self_ms"])


# ------------------------------------------------------------------------------------- the checker
run_checker = checker('01_single_device', timeout=600)


def test_checker_passes_the_solutions():
    code, out = run_checker("--solutions", as_learner=True)
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out


def test_checker_fails_the_stubs_naming_not_implemented():
    code, out = run_checker()
    assert code == 1, out
    for name in ("count_parameters", "model_state_bytes", "activation_bytes_per_layer", "accumulate_gradients", "plan_step",
                 "phase_ms"):
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


WRONG_TRACES = {
    "microseconds": ("def phase_ms(trace):\n    out = {}\n    for e in trace['traceEvents']:\n"
                     "        if e.get('ph') == 'X' and e.get('cat') == 'user_annotation' and not "
                     "e['name'].startswith(('step ', 'picotron:')):\n"
                     "            p = e['name'].split(' mb=')[0]\n            out[p] = out.get(p, 0.0) + e['dur']\n"
                     "    return out\n", "a trace's ts and dur are microseconds: divide by 1000"),
    "operators": ("def phase_ms(trace):\n    out = {}\n    for e in trace['traceEvents']:\n"
                  "        if e.get('ph') == 'X' and not e['name'].startswith(('step ', 'picotron:')):\n"
                  "            p = e['name'].split(' mb=')[0]\n            out[p] = out.get(p, 0.0) + e['dur'] / 1e3\n"
                  "    return out\n", "aten::mm is torch's operator inside the phase"),
    "steps": ("def phase_ms(trace):\n    out = {}\n    for e in trace['traceEvents']:\n"
              "        if e.get('ph') == 'X' and e.get('cat') == 'user_annotation':\n"
              "            p = e['name'].split(' mb=')[0]\n            out[p] = out.get(p, 0.0) + e['dur'] / 1e3\n"
              "    return out\n", "leave out the step ranges and the start marker"),
}


@pytest.mark.parametrize("mistake", sorted(WRONG_TRACES))
def test_checker_names_trace_mistakes(tmp_path, mistake):
    code, why = WRONG_TRACES[mistake]
    wrong = tmp_path / f"wrong_{mistake}.py"
    wrong.write_text(code)
    status, out = run_checker("--module", str(wrong), "phase_ms")
    assert status == 1 and "FAIL  phase_ms(a --profile 2:3 trace)" in out and why in out, out


WRONG_PLAN = '''
def plan_step(model_config, seq_len, global_batch, budget_bytes):
    if model_config.attn_impl == "eager":  # recomputes everything although selective recomputation fits
        return {"micro_batch_size": 2, "grad_acc": global_batch // 2, "recompute": "full"}
    if budget_bytes >= 200 * 2**20:  # changes the global batch
        return {"micro_batch_size": global_batch // 2, "grad_acc": 1, "recompute": "none"}
    return {"micro_batch_size": global_batch, "grad_acc": 1, "recompute": "none"}  # never accumulates
'''


def test_checker_explains_a_wrong_plan(tmp_path):
    wrong = tmp_path / "wrong_plan.py"
    wrong.write_text(WRONG_PLAN)
    code, out = run_checker("--module", str(wrong), "plan_step")
    assert code == 1, out
    assert "micro_batch_size x grad_acc = 8 x 1 = 8 sequences, but the global batch is 16" in out, out
    assert "(tight: tiny, s=256, global batch 16, 100 MiB): over budget by" in out, out
    assert "the activations of micro-batch 16 dominate; try a smaller micro-batch with more accumulation steps" in out
    assert "micro-batch 2 x 4, recompute full fits (measured peak" in out, out
    assert "it recomputes (full) although micro-batch 1 x 8, recompute selective fits" in out, out
    assert "Measured: yours" in out and "the reference's" in out


def test_puzzle_messages_name_the_cause():
    import check

    tiny = ModelConfig.from_preset("tiny")
    assert "the model states alone exceed the budget" in check.over_budget(tiny, 256, 1, "full", 2**20)
    assert "micro-batch 1 is as small as it gets: keep fewer activations with recomputation" in \
        check.over_budget(tiny, 256, 1, "none", 20 * 2**20)
    ref = {"micro_batch_size": 4, "grad_acc": 4, "recompute": "none"}
    assert "2 micro-batches of 8" not in check.slower_than({"micro_batch_size": 8, "grad_acc": 2, "recompute": "none"}, ref)
    assert "8 micro-batches of 2 where 4 of 4 fit" in check.slower_than(
        {"micro_batch_size": 2, "grad_acc": 8, "recompute": "none"}, ref)
    assert "it recomputes (selective)" in check.slower_than({"micro_batch_size": 4, "grad_acc": 4, "recompute": "selective"}, ref)
    assert check.slower_than(ref, ref) == ""
    assert "positive ints" in check.malformed({"micro_batch_size": 0, "grad_acc": 1, "recompute": "none"})


# ------------------------------------------------------------------------------------- the notebook
def test_notebook_runs_in_fast_mode(run_notebook):
    text = run_notebook("01_single_device")
    assert "✗" not in text, text
    assert text.count("✓") >= 12
