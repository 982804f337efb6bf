"""One home for each rule and each formula: lessons, benchmarks and the planner's command line call them, none keeps
a copy. Every .py under picotron/, lessons/ and benchmarks/ is parsed (not imported); each name below may be defined
(a def, a class or an assignment) only in its home. A lesson's exercise.py and solution.py are left out: there the
learner writes the formula on purpose. A few names are handed on under the same name by a function whose body only
calls the home (a recipe's name turned into the home's arguments): those are listed, and checked to do no arithmetic."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HOMES = {  # name: the one file that defines it
    "model_state_bytes": "picotron/planner.py",
    "zero_model_state_bytes": "picotron/planner.py",
    "korthikanti_bytes_per_layer": "picotron/planner.py",
    "SP_INPUT_COPIES": "picotron/planner.py",
    "ulysses_kv_heads": "picotron/planner.py",
    "ulysses_buffer_bytes": "picotron/planner.py",
    "cp_bytes_per_step": "picotron/planner.py",  # the bytes every context-parallel core sends (ring, all-gather, Ulysses)
    "cp_messages_per_layer": "picotron/planner.py",  # their messages (the α term): 3c-2, 2(c-1), 8(c-1) (issue 45)
    "hsdp_bytes_per_step": "picotron/planner.py",  # HSDP's bytes on the shard and the replicate links (issue 43)
    "muon_bytes_per_step": "picotron/planner.py",  # Muon's exchange, gather or owner (issue 44)
    "fp8_scale_bytes": "picotron/planner.py",  # fine-grained FP8's scales (issue 44)
    "async_tp_exposed_seconds": "picotron/planner.py",  # a collective matmul's exposed ring steps (issue 43)
    "async_tp_layer_seconds": "picotron/planner.py",
    "ep_overlap_exposed_seconds": "picotron/planner.py",  # --ep-overlap's exposed all-to-alls (issue 43)
    "bytes_per_step_formula": "picotron/expert_parallel.py",  # context_parallel's is the planner's, imported
    "bubble_formula": "picotron/pipeline_schedules.py",
    "dualpipe_bubble": "picotron/plan/time_model.py",
    "ridge": "picotron/plan/hardware.py",  # the roofline of lesson 00 (issue 45): ridge, roof, FLOPs and bytes of an op
    "roofline": "picotron/plan/hardware.py",
    "op_cost": "picotron/plan/hardware.py",
    "HBM_BANDWIDTH": "picotron/plan/hardware.py",
    "flops_per_token": "picotron/model_config.py",
    "step_time": "picotron/plan/time_model.py",
    "combination_problem": "picotron/rules.py",
    "layout_problem": "picotron/rules.py",
    "tp_shape_problem": "picotron/rules.py",
    "trainer_problem": "picotron/plan/search.py",
}
# (file, name): a function of that name whose body only calls the home with other arguments
PASS_THROUGHS = {("picotron/precision.py", "model_state_bytes"), ("picotron/metrics.py", "flops_per_token")}


def sources():
    for folder in ("picotron", "lessons", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name in ("exercise.py", "solution.py") or "__pycache__" in path.parts:
                continue
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def definitions(tree):
    """(name, node) of every def and class anywhere in the module (methods and nested ones too) and of every name
    the module assigns at its top level (a function's local variable of the same name is not a copy)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for t in ast.walk(target):
                    if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store):
                        yield t.id, node


def copies(found):
    """[(file, name)] of every definition of a listed name outside its home (pass-throughs excepted)."""
    out = []
    for path, tree in found:
        for name, node in definitions(tree):
            home = HOMES.get(name)
            if home is None or path == home:
                continue
            if (path, name) in PASS_THROUGHS and _only_calls(node):
                continue
            out.append((path, name))
    return out


def _only_calls(node):
    """A function that computes nothing itself: no arithmetic in its body."""
    return isinstance(node, ast.FunctionDef) and not any(isinstance(n, (ast.BinOp, ast.AugAssign))
                                                         for n in ast.walk(node))


def test_every_formula_and_rule_is_defined_in_its_home_only():
    found = list(sources())
    assert {home for home in HOMES.values()} <= {path for path, _ in found}
    homes = {(path, name) for path, tree in found for name, _ in definitions(tree)}
    assert all((home, name) in homes for name, home in HOMES.items()), "a home lost its definition"
    assert copies(found) == [], "defined outside its home (import it from there instead)"


def test_a_copy_is_caught():
    """The check can fail: a lesson that re-derives a formula, a plan module that keeps a rule, a pass-through that
    does arithmetic."""
    lesson = ast.parse("def korthikanti_bytes_per_layer(s, b, h, a):\n    return 34 * s * b * h\n"
                       "SP_INPUT_COPIES = {'attention': 3, 'mlp': 2}\n")
    plan = ast.parse("def combination_problem(cfg, mc):\n    return None\n")
    precision = ast.parse("def model_state_bytes(n, name):\n    return {'params': 4 * n}\n")
    fine = ast.parse("from picotron.planner import SP_INPUT_COPIES, korthikanti_bytes_per_layer\n"
                     "def model_state_bytes(n, name):\n    return planner.model_state_bytes(n, 'fp32')\n")
    assert copies([("lessons/05_tensor_parallel/experiment.py", lesson), ("picotron/plan/search.py", plan),
                   ("picotron/precision.py", precision)]) == [
        ("lessons/05_tensor_parallel/experiment.py", "korthikanti_bytes_per_layer"),
        ("lessons/05_tensor_parallel/experiment.py", "SP_INPUT_COPIES"),
        ("picotron/plan/search.py", "combination_problem"), ("picotron/precision.py", "model_state_bytes")]
    assert copies([("picotron/precision.py", fine)]) == []


@pytest.fixture(scope="module")
def lesson05():
    import importlib.util
    path = ROOT / "lessons" / "05_tensor_parallel" / "experiment.py"
    spec = importlib.util.spec_from_file_location("lesson05_experiment_one_home", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lesson05_numbers_are_the_planners(lesson05):
    from picotron import planner
    from picotron.model_config import ModelConfig
    mc = ModelConfig.from_preset("llama3-8b")
    s, b, h, a = 8192, 1, mc.hidden_size, mc.num_attention_heads
    for tp, sp in ((1, False), (8, False), (8, True)):
        m = lesson05.memory_per_rank(mc, tp, sp=sp, seq_len=s)
        assert m["activations"] == mc.num_hidden_layers * planner.korthikanti_bytes_per_layer(s, b, h, a, tp=tp, sp=sp,
                                                                                              flash=True)
    assert m["activations"] == pytest.approx(mc.num_hidden_layers * 34 * s * b * h / 8)  # Korthikanti's Table 2
    n = lesson05.params_per_rank(mc, 4)
    assert lesson05.rank_state_bytes(mc, 4, "mixed") == planner.model_state_bytes(n, "bf16")
    ours = lesson05.rank_state_bytes(mc, 4)
    assert ours == planner.model_state_bytes(n, "fp32", tensors=planner.param_tensors(mc))
    assert ours["optimizer"] == 8 * n + 4 * planner.param_tensors(mc)
    assert lesson05.SP_INPUT_COPIES is planner.SP_INPUT_COPIES


def test_the_context_parallel_cores_and_the_time_model_count_the_planners_bytes():
    from picotron import planner
    from picotron.plan import time_model
    import picotron.context_parallel as cpm
    assert cpm.bytes_per_step_formula is planner.cp_bytes_per_step and cpm.ulysses_kv_heads is planner.ulysses_kv_heads
    assert "cp_bytes_per_step" in time_model.step_time.__code__.co_names
    # the ring: cp-1 K/V blocks forward, cp-1 again backward, cp fp32 dK/dV blocks (3cp - 2 messages)
    block = 2 * 1 * 2 * (64 // 4) * 8
    assert planner.cp_bytes_per_step(4, 1, 64, 2, 8, layers=1) == block * 4 * (3 * 4 - 2)
