"""The planner: memory per rank of any layout, the step-time model, the search and its reasons, the command line,
the published runs. Expected values are derived here by hand (parameter counts, the ZeRO table, ring formulas),
not read back from the planner; the memory model against real runs is in test_planner_measured.py."""
import dataclasses

import pytest

from picotron import plan, planner
from picotron.model import ModelConfig
from picotron.planner import Layout

TINY = ModelConfig.from_preset("tiny")  # untied, 4 layers, 8 heads, 4 KV heads
S = 64


def test_layout_parse_reads_any_order_and_names_a_bad_item():
    a = Layout.parse("tp8,pp16,dp128")
    assert (a.dp, a.tp, a.pp, a.cp, a.ep, a.gpus) == (128, 8, 16, 1, 1, 16384)
    assert Layout.parse("dp128, pp16, tp8") == a
    b = Layout.parse("cp2,tp2,sp,zero1,mbs4,ga8,interleaved,v2,recompute-full")
    assert (b.cp, b.sp, b.zero, b.micro_batch_size, b.grad_acc, b.pp_schedule, b.pp_chunks, b.recompute) == \
        (2, True, 1, 4, 8, "interleaved", 2, "full")
    with pytest.raises(ValueError, match="layout item 'xx4'"):
        Layout.parse("tp2,xx4")


def test_one_rank_holds_the_single_device_bytes():
    n = TINY.num_params()
    row = planner.memory_per_gpu(TINY, Layout(micro_batch_size=2), S)
    assert (row["params"], row["grads"], row["optimizer"]) == (4 * n, 4 * n, 8 * n)
    assert row["activations"] == planner.activation_bytes(TINY, S, 2)
    assert row["total"] == 16 * n + planner.activation_bytes(TINY, S, 2)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_shards_what_the_paper_says(zero):
    n, dp = TINY.num_params(), 4
    row = planner.memory_per_gpu(TINY, Layout(dp=dp, zero=zero), S)
    want = {0: (4, 4, 8), 1: (4, 4, 8 / dp), 2: (4, 4 / dp, 8 / dp), 3: (4 / dp, 4 / dp, 8 / dp)}[zero]
    assert [row[k] for k in ("params", "grads", "optimizer")] == pytest.approx([w * n for w in want], abs=2)


def test_tp_cuts_every_matmul_and_keeps_the_norms():
    h, L, v = TINY.hidden_size, TINY.num_hidden_layers, TINY.vocab_size
    norms = (2 * L + 1) * h
    matmuls = TINY.num_params() - norms  # the embedding and the head are vocabulary-parallel
    for t in (2, 4):
        assert planner.memory_per_gpu(TINY, Layout(tp=t), S)["params"] == 4 * (matmuls // t + norms)
    del v


def test_pipeline_stages_hold_every_parameter_once_and_their_micro_batches():
    n = TINY.num_params()
    for p in (2, 4):
        rows = planner.memory_per_stage(TINY, Layout(pp=p, grad_acc=8), S)
        assert sum(r["params"] for r in rows) == 4 * n  # untied: no copy of the embedding
    one = planner.memory_per_stage(TINY, Layout(pp=2, grad_acc=1), S)
    afab = planner.memory_per_stage(TINY, Layout(pp=2, grad_acc=8, pp_schedule="afab"), S)
    ofob = planner.memory_per_stage(TINY, Layout(pp=2, grad_acc=8), S)
    for stage in (0, 1):
        assert afab[stage]["activations"] == 8 * one[stage]["activations"]  # AFAB: all m alive
        assert ofob[stage]["activations"] == (2 - stage) * one[stage]["activations"]  # 1F1B: p - i


def test_cp_gives_each_rank_the_activations_of_its_tokens():
    long = planner.memory_per_gpu(TINY, Layout(cp=2, micro_batch_size=2), 2 * S)
    short = planner.memory_per_gpu(TINY, Layout(micro_batch_size=2), S)
    assert long["activations"] == short["activations"] and long["params"] == short["params"]


def test_full_recomputation_keeps_the_layer_inputs():
    row = planner.memory_per_gpu(TINY, Layout(micro_batch_size=2, recompute="full"), S)
    layers = TINY.num_hidden_layers * 4 * S * 2 * TINY.hidden_size
    assert row["activations"] == layers + planner.model_level_activation_bytes(TINY, S, 2, recompute="full")


def test_ring_collectives_follow_the_alpha_beta_formulas():
    a, bw, nbytes = 1e-5, 1e9, 8e6
    assert plan._ring("all_reduce", 4, nbytes, a, bw) == pytest.approx(6 * a + 1.5 * nbytes / bw)
    assert plan._ring("all_gather", 4, nbytes, a, bw) == pytest.approx(3 * a + 0.75 * nbytes / bw)
    assert plan._ring("all_reduce", 1, nbytes, a, bw) == 0


def test_step_time_adds_the_bubble_of_the_schedule_and_hides_small_gradient_syncs():
    hw = plan.GPUS["h100-80gb"]
    mc = ModelConfig.from_preset("smollm-360m")
    t = plan.step_time(mc, Layout(pp=2, grad_acc=4), 2048, hw)
    busy = t["compute"] + t["tp"] + t["cp"] + t["ep"] + t["pp"]
    assert t["bubble"] == pytest.approx(busy * (1 / 5) / (4 / 5))  # (p-1)/(m+p-1) = 1/5 of the step
    flops = mc.flops_per_token(2048) * 4 * 2048
    assert t["compute"] == pytest.approx(flops / 2 / (hw.peak * hw.efficiency))
    dp = plan.step_time(mc, Layout(dp=8, grad_acc=4), 2048, hw)
    assert dp["dp"] == 0  # 360 M bf16 gradients over NVLink: shorter than the last backward
    full = plan.step_time(mc, Layout(grad_acc=4, recompute="full"), 2048, hw)
    none = plan.step_time(mc, Layout(grad_acc=4), 2048, hw)
    assert full["compute"] == pytest.approx(none["compute"] * (1 + (mc.flops_per_token(2048) / 3) / mc.flops_per_token(2048)))
    assert none["mfu"] == pytest.approx(hw.efficiency)  # one GPU, nothing else: exactly the efficiency


def test_search_ranks_by_throughput_and_says_why_each_rejected_layout_fails():
    hw = dataclasses.replace(plan.GPUS["h100-80gb"], memory=2 * plan.GiB)
    mc = ModelConfig.from_preset("smollm-360m")
    result = plan.search(mc, 8, hw, 2048, 48)
    speeds = [t["tokens_per_s"] for _, _, t in result.ranked]
    assert result.ranked and speeds == sorted(speeds, reverse=True)
    assert all(m["total"] <= hw.memory for _, m, _ in result.ranked)
    reasons = [why for _, why in result.rejected]
    assert all(why for why in reasons)
    assert any(why.startswith("does not fit:") and "> 2.0 GiB" in why for why in reasons)
    assert any("is not divisible by dp·mbs" in why for why in reasons)  # 48 sequences, dp 8 x mbs 8
    assert any(why.startswith("tp=8 does not divide the 15 attention heads") for why in reasons)
    fits, why = plan.check_layout(mc, Layout(dp=8, micro_batch_size=2, grad_acc=3, zero=3), 2048, hw, 48)
    assert why is None or why.startswith("does not fit")


def test_the_command_line_ranks_and_evaluates(capsys):
    assert plan.main(["--preset", "smollm-1.7b", "--gpus", "16", "--seq-len", "2048",
                      "--global-batch-tokens", "512K", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "256 sequences (524,288 tokens) per step" in out and "rejected, by reason" in out
    assert len([line for line in out.splitlines() if "GiB" not in line and "mbs" in line and "%" in line]) >= 3
    assert plan.main(["--preset", "smollm-1.7b", "--gpus", "16", "--seq-len", "2048", "--global-batch-tokens", "512K",
                      "--layout", "dp8,tp2,zero1"]) == 0
    out = capsys.readouterr().out
    assert "dp8,tp2,zero1,mbs1,ga32: fits" in out and "memory per GPU (GiB): params" in out
    assert plan.main(["--hidden-size", "1024", "--num-hidden-layers", "8", "--gpus", "8", "--seq-len", "1024",
                      "--global-batch-tokens", "64K", "--top", "1"]) == 0
    assert "llama3-8b (" in capsys.readouterr().out  # the preset's other fields, these two overridden


@pytest.mark.parametrize("args, message", [
    (["--gpu", "tpu"], "--gpu 'tpu' is not known; pick one of a100-40gb"),
    (["--global-batch-tokens", "lots"], "--global-batch-tokens 'lots' is not a number of tokens"),
    (["--global-batch-tokens", "1000", "--seq-len", "4096"], "is not a whole number of sequences"),
    (["--layout", "tp8,pp2", "--gpus", "8"], "uses 16 GPUs (dp·tp·pp·cp), not --gpus 8"),
    (["--layout", "tp8,zz2", "--gpus", "8"], "layout item 'zz2'"),
])
def test_bad_input_gets_one_sentence(capsys, args, message):
    assert plan.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("picotron.plan: error: ") and message in err and "\n" not in err


def test_published_runs_fit_and_their_throughput_is_predicted_within_a_third():
    for run in plan.PUBLISHED:
        r = plan.evaluate_published(run, rank=False)
        assert r["fits"], (run.name, r["why"])
        assert 0.67 < r["ratio"] < 1.5, (run.name, r["predicted_tflops"], run.tflops)
        assert run.layout.gpus == run.gpus and run.layout.dp * run.layout.micro_batch_size * run.layout.grad_acc \
            == run.global_seqs, run.name


def test_bloom_is_ranked_among_the_candidates_with_the_reasons_above_it():
    bloom = next(r for r in plan.PUBLISHED if r.name == "BLOOM-176B")
    r = plan.evaluate_published(bloom)
    assert r["rank"] is not None and 1 <= r["rank"] <= r["of"]
    assert r["above"] == r["rank"] - 1 and r["above_less_recompute"] <= r["above"]
    assert r["best"][2]["tokens_per_s"] >= r["time"]["tokens_per_s"]
