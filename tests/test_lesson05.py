"""Lesson 05: the exercise checker (the solutions pass; the stubs fail naming NotImplementedError; wrong answers are
reported with their rank, tensor and likely cause; a hang with the waiting rank and its line; the puzzle's classic
mistakes named), the widget's shard shapes and memory model against hand-computed numbers, the lesson's formulas,
the puzzle's planner, and the notebook end to end in FAST mode.

No timing is asserted: on a shared CPU timings are measurements, not pass/fail criteria.
"""
import sys
from pathlib import Path

import pytest
from _lessons import checker

from picotron.model import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "lessons" / "05_tensor_parallel" / "solution.py"
sys.path.insert(0, str(ROOT / "lessons"))


run_checker = checker('05_tensor_parallel', timeout=240)


def test_checker_passes_the_solutions():
    code, out = run_checker("--solutions", as_learner=True)
    assert code == 0, out
    assert "all checks passed" in out and "FAIL" not in out
    assert out.count("  ok  ") == 10, out  # four exercises on 2 and on 4 ranks, the puzzle and the ring order
    assert "tp=4 + sp, micro-batch 2 held 22.77 MiB on its fullest rank (<= 23)" in out, out  # its real step


def test_checker_fails_the_stubs_naming_not_implemented():
    code, out = run_checker()
    assert code == 1, out
    for what in ("CopyToTP and ReduceFromTP on 2 ranks", "parallel_mlp on 2 ranks", "vocab_parallel_cross_entropy on 2 ranks"):
        assert f"FAIL  {what}: rank " in out, out
    assert "FAIL  plan (the puzzle): NotImplementedError: not written yet" in out, out
    assert "FAIL  keep_my_piece and rebuild_input on 2 ranks: rank " in out, out
    assert "FAIL  ring_steps (async TP's ring order): NotImplementedError: not written yet" in out, out
    assert out.count("NotImplementedError: not written yet") == 6, out
    assert "on 4 ranks" not in out  # it stops at the first world size


def mutate(tmp_path, *bugs, name="wrong.py"):
    """The solutions with the given (old, new) replacements."""
    text = SOLUTIONS.read_text()
    for old, new in bugs:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


def test_checker_names_a_missing_all_reduce_in_fs_backward_and_an_in_place_one_in_g(tmp_path):
    path = mutate(tmp_path,
                  ("        dist.all_reduce(grad, group=ctx.group)  # each", "        pass  # each"),  # f's backward
                  ("        out = x.clone()  # all_reduce", "        out = x  # all_reduce"))  # g all-reduces in place
    code, out = run_checker("--module", str(path), "f_and_g")
    assert code == 1, out
    assert ("FAIL  CopyToTP and ReduceFromTP on 2 ranks: rank 0: missing all-reduce in backward of f: x's gradient on "
            "rank 0 is only rank 0's partial sum") in out, out
    assert "FAIL  CopyToTP and ReduceFromTP on 4 ranks: rank 0: missing all-reduce in backward of f" in out, out

    path = mutate(tmp_path, ("        out = x.clone()  # all_reduce", "        out = x  # all_reduce"))
    code, out = run_checker("--module", str(path), "f_and_g")
    assert code == 1, out
    assert "rank 0: ReduceFromTP.forward all-reduced its input IN PLACE: the caller's tensor changed" in out, out


def test_checker_names_a_partial_output_and_counts_a_second_f(tmp_path):
    no_g = mutate(tmp_path, ("    return ReduceFromTP.apply(F.linear(h, down_w), group)", "    return F.linear(h, down_w)"))
    code, out = run_checker("--module", str(no_g), "parallel_mlp")
    assert code == 1, out
    assert ("FAIL  parallel_mlp on 2 ranks: rank 0: the output is rank 0's partial sum: the row-parallel down "
            "projection") in out, out
    assert "g (ReduceFromTP) after the down projection" in out, out

    two_f = mutate(tmp_path, ("    x = CopyToTP.apply(x, group)  # once, for both column-parallel layers: ONE all-reduce "
                              "of x's gradient\n    h = F.silu(F.linear(x, gate_w)) * F.linear(x, up_w)",
                              "    h = F.silu(F.linear(CopyToTP.apply(x, group), gate_w)) * "
                              "F.linear(CopyToTP.apply(x, group), up_w)"))
    code, out = run_checker("--module", str(two_f), "parallel_mlp")
    assert code == 1, out
    assert ("FAIL  parallel_mlp on 2 ranks: rank 0: right values, but 1 all-reduce(s) in forward and 2 in backward — "
            "f applied to x separately for gate and for up?") in out, out


def test_checker_recognises_each_ranks_own_maximum_and_a_local_sum(tmp_path):
    own_max = mutate(tmp_path, ("    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)", "    pass"))
    code, out = run_checker("--module", str(own_max), "vocab_parallel_cross_entropy")
    assert code == 1, out
    assert "FAIL  vocab_parallel_cross_entropy on 2 ranks: rank 0: losses wrong — matches using each rank's OWN row " \
           "maximum" in out, out

    local_sum = mutate(tmp_path, ("    dist.all_reduce(sum_exp, group=group)", "    pass"))
    code, out = run_checker("--module", str(local_sum), "vocab_parallel_cross_entropy")
    assert code == 1, out
    assert "losses wrong — matches log of THIS rank's sum of exponentials" in out, out


def test_checker_names_the_partitioned_checkpoints_mistakes(tmp_path):
    """Exercise 5: a cut of the sequence, another rank's columns, a view of x, pieces stacked along the batch."""
    keep = "    return x.chunk(n, dim=-1)[r].clone()"
    cases = [((keep, "    return x.chunk(n, dim=1)[r].clone()"), "keep_my_piece cut dim 1, the sequence: the piece is "
                                                                   "the hidden columns"),
             ((keep, "    return x.chunk(n, dim=-1)[n - 1 - r].clone()"), "rank 0: keep_my_piece kept rank 1's columns "
                                                                          "[4, 8); rank 0 keeps [0, 4)"),
             ((keep, "    return x.chunk(n, dim=-1)[r]"), "keep_my_piece returned a view of x: it shares x's storage"),
             (("    return torch.cat(parts, dim=-1)", "    return torch.cat(parts, dim=0)"),
              "rebuild_input stacked the pieces along dim 0 (the batch), as all_gather_into_tensor does"),
             (("    return torch.cat(parts, dim=-1)", "    return torch.cat(parts[::-1], dim=-1)"),
              "rank 0: columns [0, 4) hold rank 1's piece, they belong to rank 0: put the pieces in rank order")]
    for k, (bug, message) in enumerate(cases):
        code, out = run_checker("--module", str(mutate(tmp_path, bug, name=f"wrong{k}.py")), "partition")
        assert code == 1 and f"FAIL  keep_my_piece and rebuild_input on 2 ranks: rank 0: " in out, out
        assert message in out, out


def test_checker_names_the_ring_orders_mistakes(tmp_path):
    """Exercise 6 (async TP): the chunks passed the wrong way, a message too many, a step that starts with another
    rank's chunk, the wrong neighbour."""
    chunk = "        chunk = (rank - i) % n"
    last = "        last = i == n - 1"
    cases = [((chunk, "        chunk = (rank + i) % n"), "ring_steps(0, 3): at step 1 rank 0 multiplies chunk 1, its "
                                                         "RIGHT neighbour's"),
             ((last, "        last = False"), "ring_steps(0, 2): the last step still sends to 1 / receives from 1; "
                                             "by then every rank has every chunk: 1 messages, not 2"),
             ((chunk, "        chunk = (rank - i - 1) % n"), "ring_steps(0, 2): at step 0 rank 0 multiplies chunk 1, "
                                                              "but it holds only its own chunk"),
             (("    right, left = (rank + 1) % n, (rank - 1) % n", "    right, left = (rank - 1) % n, (rank - 1) % n"),
              "ring_steps(0, 3): at step 0 rank 0 sends to 2; chunks travel one way around the ring, to the right "
              "neighbour, 1")]
    for k, (bug, message) in enumerate(cases):
        code, out = run_checker("--module", str(mutate(tmp_path, bug, name=f"ring{k}.py")), "ring")
        assert code == 1 and "FAIL  ring_steps (async TP's ring order): " in out, out
        assert message in out, out


def test_checker_names_a_hang_and_the_waiting_line(tmp_path):
    hang = mutate(tmp_path, ("        dist.all_reduce(out, group=group)\n        return out",
                             "        if dist.get_rank(group) == 0:\n            dist.all_reduce(out, group=group)\n"
                             "        return out"))
    code, out = run_checker("--module", str(hang), "f_and_g", "--timeout", "5")
    assert code == 1, out
    assert "FAIL  CopyToTP and ReduceFromTP on 2 ranks: hang: rank 0 still waiting after 5 s" in out, out
    assert "rank 1 finished and waited for it" in out, out
    assert "rank 0 waits in forward, line " in out and "dist.all_reduce(out, group=group)" in out, out
    assert "on 4 ranks" not in out  # a hang is not retried on the next world size


def test_checker_names_the_puzzles_mistakes(tmp_path):
    every = mutate(tmp_path, ("lesson.activation_bytes(mc, seq, b, tp, sp)", "lesson.activation_bytes(mc, seq, batch, tp, sp)"))
    code, out = run_checker("--module", str(every), "plan")
    assert code == 1, out
    assert ("FAIL  plan (the puzzle): plan(100) = tp=2, micro-batch 8: fits (82.68 MiB per rank), but tp=1, micro-batch 4 "
            "fits too (94.15 MiB per rank) and is faster: fewer tp ranks — you counted the activations of all 8 "
            "sequences") in out, out

    always = mutate(tmp_path, ("for sp in (False, True) if tp > 1 else (False,):", "for sp in (True,) if tp > 1 else (False,):"))
    code, out = run_checker("--module", str(always), "plan")
    assert code == 1, out
    assert "plan(40) = tp=2 + sp, micro-batch 1: fits (32.64 MiB per rank), but tp=2, micro-batch 2 fits too" in out, out
    assert "at tp=2 ours keeps MORE activations than tp alone" in out, out

    never = mutate(tmp_path, ("for sp in (False, True) if tp > 1 else (False,):", "for sp in (False,):"))
    code, out = run_checker("--module", str(never), "plan")
    assert code == 1, out
    assert "plan(23) = tp=4, micro-batch 1:" in out and "sp's smaller norms save just enough" in out, out


# ------------------------------------------------------------------------------------------- the puzzle
def test_the_puzzles_planner_by_hand(lesson):
    """Each budget's answer fits, and every layout the ranking puts before it does not (the formulas are exact:
    the memory experiment and the checker's real steps measure them)."""
    mc, MiB = lesson.puzzle_model(), 2**20
    answers = {b: lesson.best_plan(b) for b in lesson.PUZZLE["budgets_mib"]}
    assert answers == {160: (1, False, 8), 100: (1, False, 4), 64: (1, False, 1), 40: (2, False, 2),
                       23: (4, True, 2), 12: None}
    order = lesson.layouts(mc)
    assert order[0] == (1, False, 8) and order[-1] == (4, True, 1) and len(order) == 4 + 2 * 4 + 2 * 4
    for budget, best in answers.items():
        before = order if best is None else order[:order.index(best)]
        assert all(lesson.rank_bytes(mc, *x) > budget * MiB for x in before), budget
        assert best is None or lesson.rank_bytes(mc, *best) <= budget * MiB
    assert lesson.rank_bytes(mc, 2, True, 2) > 40 * MiB > lesson.rank_bytes(mc, 2, False, 2)  # the sp trap at tp=2
    assert lesson.rank_bytes(mc, 4, False, 2) > 23 * MiB > lesson.rank_bytes(mc, 4, True, 2)  # sp pays at tp=4


# ------------------------------------------------------------------------------ the widget's shard shapes
@pytest.fixture(scope="module")
def lesson():
    import _common

    return _common.load_lesson("05_tensor_parallel")


def by_name(rows):
    return {r["name"]: r for r in rows}


def test_shard_shapes_of_llama3_8b_at_tp_8_by_hand(lesson):
    """h = 4096, 32 heads of 128, 8 KV heads, i = 14336, v = 128256, untied: each rank 4 query heads (512 rows of
    q), 1 KV head (128 rows of k and v), 1792 MLP columns, 16032 vocabulary rows."""
    shapes = lesson.shard_shapes(ModelConfig.from_preset("llama3-8b"), 8)
    assert sorted(shapes) == list(range(8))
    expected = {"embed_tokens.weight": ((128256, 4096), (16032, 4096), 0),
                "layers.0.input_layernorm.weight": ((4096,), (4096,), None),
                "layers.0.self_attn.q_proj.weight": ((4096, 4096), (512, 4096), 0),
                "layers.0.self_attn.k_proj.weight": ((1024, 4096), (128, 4096), 0),
                "layers.0.self_attn.v_proj.weight": ((1024, 4096), (128, 4096), 0),
                "layers.0.self_attn.o_proj.weight": ((4096, 4096), (4096, 512), 1),
                "layers.0.post_attention_layernorm.weight": ((4096,), (4096,), None),
                "layers.0.mlp.gate_proj.weight": ((14336, 4096), (1792, 4096), 0),
                "layers.0.mlp.up_proj.weight": ((14336, 4096), (1792, 4096), 0),
                "layers.0.mlp.down_proj.weight": ((4096, 14336), (4096, 1792), 1),
                "norm.weight": ((4096,), (4096,), None),
                "lm_head.weight": ((128256, 4096), (16032, 4096), 0)}
    for rank in (0, 3, 7):
        rows = by_name(shapes[rank])
        assert set(rows) == set(expected)
        for name, (full, shard, dim) in expected.items():
            r = rows[name]
            assert (r["full"], r["shard"], r["dim"]) == (full, shard, dim), name
            if dim is not None:
                assert (r["lo"], r["hi"]) == (rank * shard[dim], (rank + 1) * shard[dim]), name
    assert by_name(shapes[7])["lm_head.weight"]["kind"] == "column-parallel (vocabulary)"


def test_shard_shapes_of_a_tied_model_and_the_divisibility_rule(lesson):
    """SmolLM-135M: h = 576, 9 heads of 64, 3 KV heads, i = 1536, v = 49152, tied: tp = 3 is the only split."""
    mc = ModelConfig.from_preset("smollm-135m")
    assert lesson.valid_tps(mc) == [1, 3]
    rows = by_name(lesson.shard_shapes(mc, 3, sp=True)[2])
    assert rows["layers.0.self_attn.q_proj.weight"]["shard"] == (192, 576)  # 3 query heads
    assert rows["layers.0.self_attn.k_proj.weight"]["shard"] == (64, 576)  # 1 KV head
    assert rows["layers.0.mlp.down_proj.weight"]["shard"] == (576, 512)
    assert rows["lm_head.weight"]["kind"] == "tied to embed_tokens.weight"
    assert rows["lm_head.weight"]["shard"] == rows["embed_tokens.weight"]["shard"] == (16384, 576)
    assert (rows["embed_tokens.weight"]["lo"], rows["embed_tokens.weight"]["hi"]) == (32768, 49152)
    with pytest.raises(ValueError, match="tp=4 is more than num_key_value_heads=3"):
        lesson.shard_shapes(mc, 4)
    with pytest.raises(ValueError, match="tp=2 does not divide num_attention_heads=9"):
        lesson.shard_shapes(mc, 2)
    assert lesson.valid_tps(ModelConfig.from_preset("smollm-360m")) == [1]  # 5 divides the heads, not 49152


def test_params_per_rank_matches_the_sharded_model(lesson):
    for preset, tp in (("tiny", 4), ("smollm-135m", 3), ("llama3-8b", 8)):
        mc = ModelConfig.from_preset(preset)
        rows = lesson.shard_shapes(mc, tp)[0]
        per_layer = sum(_numel(r["shard"]) for r in rows if r["name"].startswith("layers.0."))
        outer = sum(_numel(r["shard"]) for r in rows if not r["name"].startswith("layers.")
                    and not r["kind"].startswith("tied"))
        assert lesson.params_per_rank(mc, tp) == mc.num_hidden_layers * per_layer + outer, preset
    mc = ModelConfig.from_preset("llama3-8b")
    assert lesson.params_per_rank(mc, 8) == (mc.num_params() - 65 * 4096) // 8 + 65 * 4096


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_memory_per_rank_by_hand(lesson):
    """Llama-3-8B, 8192 tokens: Korthikanti's 34·sbh bytes per layer (flash), x 32 layers; states 16 bytes/param."""
    mc = ModelConfig.from_preset("llama3-8b")
    sbh = 8192 * 4096
    m = lesson.memory_per_rank(mc, 8, sp=True, seq_len=8192)
    assert m["activations"] == pytest.approx(32 * 34 * sbh / 8)
    assert m["params"] + m["grads"] + m["optimizer"] == 16 * lesson.params_per_rank(mc, 8)
    no_sp = lesson.memory_per_rank(mc, 8, sp=False, seq_len=8192)
    assert no_sp["activations"] == pytest.approx(32 * sbh * (10 + 24 / 8))
    with pytest.raises(ValueError):
        lesson.memory_per_rank(mc, 16)


def test_activation_formula_has_korthikantis_shape(lesson):
    """Ours (fp32, SwiGLU, sdpa): per layer R + S/t with R = 24·sbh (norms 16, block inputs 8) and
    S = 4sb(2h + 2kd) + 4a·sb + 16sb·i; with sp the norms move from R to S, the gathered block inputs stay in R."""
    mc = ModelConfig.from_preset("tiny", hidden_size=256, intermediate_size=768)
    s, b = 128, 4
    sbh, sb = s * b * 256, s * b
    R, S = lesson.replicated_and_sharded(mc, s, b)
    assert R == 24 * sbh + 8 * sb
    assert S == pytest.approx(4 * sb * (2 * 256 + 2 * 128) + 4 * 8 * sb + 16 * sb * 768)
    Rsp, Ssp = lesson.replicated_and_sharded(mc, s, b, sp=True)  # with sp: the kept copies of the gathered inputs
    assert Rsp == 4 * sum(lesson.SP_INPUT_COPIES.values()) * sbh and Ssp == pytest.approx(S + 16 * sbh + 8 * sb)


def test_megatron_pattern(lesson):
    act = 4 * 2 * 8 * 16
    assert lesson.megatron_pattern(2, 8, 16, sp=False) == {"forward": {("all_reduce", act): 2},
                                                          "backward": {("all_reduce", act): 2}}
    sp = lesson.megatron_pattern(2, 8, 16, sp=True)
    assert sp["forward"] == {("all_gather", act): 2, ("reduce_scatter", act): 2}
    assert sp["backward"][("all_gather", act)] == 2 and sp["backward"][("all_reduce", 4 * 16)] == 2
    assert set(lesson.OPS) >= {"all_reduce", "all_gather", "reduce_scatter"}  # metrics.Recorder's kinds


def test_a_variant_steps_through_the_seam_in_one_process(lesson):
    """tp = 1 on Mesh.local(): parallelize's model, the schedule's step, no collective; the schedule's activation
    count equals PartCounter's parts; the model states are the trainer's (params, grads, optimizer)."""
    from picotron.mesh import Mesh

    cfg = lesson.make_cfg("small", num_hidden_layers=2, seq_len=32, micro_batch_size=2)
    v = lesson.Variant("one process", cfg, Mesh.local())
    v.step(1)
    v.step(2, record=False)
    assert v.calls == [] and len(v.times) == 1 and len(v.losses) == 2
    assert v.losses[1] < v.losses[0] + 0.5  # it trained, no blow-up
    v.count_parts(2)
    assert v.activation_bytes == v.parts["total"] > 0
    mc = v.run.raw.config
    assert v.parts["total"] == pytest.approx(lesson.activation_bytes(mc, 32, 2), rel=0.01)
    assert set(v.states) == {"params", "grads", "optimizer"} and v.states["grads"] == v.states["params"]


# ------------------------------------------------------------------------------------- the notebook
def test_notebook_runs_in_fast_mode(run_notebook):
    text = run_notebook("05_tensor_parallel", timeout=600)
    assert "✗" not in text, text
    assert text.count("✓") >= 54, text
    assert "NotImplementedError: not written yet" in text  # the exercise cell ran the checker on the stubs
