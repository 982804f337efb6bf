"""The parity matrix: every combination of the parallel degrees against the single process.

The variants (`variants()`, data, not hand-written cases): every layout (dp, pp, cp, tp) in {1, 2}^4 (16 layouts,
1 to 16 processes) on the dense tiny model, each with and without sp where tp = 2 and with and without ZeRO-1 where
there are dp x cp ranks to shard over (dp·cp > 1): 42 variants; plus ep = 2 on the tiny-moe preset for the layouts
with dp = 2 (expert-parallel ranks are carved out of the data-parallel ones), with the same sp and ZeRO-1 choices:
12 more. pp = 2 runs grad_acc = 2 micro-batches per step (1F1B), so the pipeline has micro-batches to overlap.
A variant the configuration refused would be listed in `REFUSED` with validate's sentence (checked below, not
silently dropped); none is refused now (ep = 2 with cp = 2, 12 variants, runs since the routing statistics are summed
over the cp ranks).

Each variant's communication is also recorded and replayed under NCCL's rules (picotron.nccl_rules: no rank's
operation may wait forever or meet a mismatched partner), and each is held to the parity standard (`tests/_parity.py`): the same seed, the same global batch (the
reference has grad_acc = dp·grad_acc), fp32, seq_len 32 (cp = 2 needs a multiple of 2·cp = 4; sp needs
seq_len/cp divisible by tp), micro-batch 2, 3 steps: every gradient of one step gathered (ZeRO shards, tp slices,
experts from the ranks that hold them) within 1e-5, the loss and gradient norm of every step within 1e-5 relative,
the validation loss too. One reference run per distinct reference (preset, grad_acc), shared by the module.

Default run: a covering subset (`DEFAULT`). The pairs of dimensions already active together elsewhere:
dp·tp, dp·sp, tp·sp, tp·zero1, sp·zero1 (test_tensor_parallel); dp·zero1 (test_zero); pp·dp, pp·tp, pp·sp,
pp·zero1 (test_pipeline_parallel); pp·zero2, pp·zero3 (test_zero); cp·dp, cp·tp, cp·sp, cp·pp, cp·zero1 (test_context_parallel); ep·dp, ep·tp,
ep·sp, ep·zero1, ep·pp (test_expert_parallel) — every feasible pair, each in two or three dimensions. Here, three
eight-process variants, three of the four degrees at 2 in each, so every pair of the seven dimensions but cp·ep is
also covered in this file: dp2·pp2·tp2 + ep2 + sp + ZeRO-1 on the MoE model (dp·pp, dp·tp, pp·tp, and ep, sp and
zero1 with each of them and each other), dp2·cp2·tp2 + sp + ZeRO-1 (dp·cp, cp·tp, cp·sp, cp·zero1) and pp2·cp2·tp2 +
sp (pp·cp) on the dense one; cp·ep is in test_expert_parallel's default (dp2·cp2·ep2, with DeepSeek's router). The
16-process variants (all four degrees at once) run in the heavy tier with the rest of the matrix: on 2 cores each
takes 35-50 s of the default tier's 12 minutes for no pair the three above miss.
`test_default_subset_covers_every_pair` checks that.

The whole matrix is in the heavy tier: `./run.sh test heavy tests/test_parity_matrix.py` (tests/conftest.py's tiers;
in the default run the other variants are skipped with a reason that names it). With
PICOTRON_MATRIX_OUT=path.json every variant that ran (and every refused one) becomes one row of a JSON table: layout,
processes, passed, the worst gradient difference relative to its tensor's largest gradient, the worst share of
the 1e-5 tolerance used by any gradient element, the worst relative difference of the loss, the gradient norm and
the validation loss, wall seconds (the parallel run alone, not the reference).
"""
import itertools
import json
import os
import platform
import time

import pytest
import torch
from _parity import SMALL, assert_matches, model_child

from picotron import nccl_rules
from picotron.config import Config, ConfigError
from picotron.launch import run_on_ranks
from picotron.parallelize import validate

DIMS = ("dp", "pp", "cp", "tp", "sp", "zero1", "ep")


def variants():
    """[(name, settings)] of the whole matrix, the refused ones included (see `refusal`)."""
    out = []
    for preset, eps in (("tiny", (1,)), ("tiny-moe", (2,))):
        for ep, (dp, pp, cp, tp) in itertools.product(eps, itertools.product((1, 2), repeat=4)):
            if dp % ep:  # ep ranks are carved out of the dp ranks: no ep = 2 variant of a dp = 1 layout
                continue
            for sp, zero in itertools.product((False, True), (0, 1)):
                if (sp and tp == 1) or (zero and dp * cp == 1):
                    continue
                layout = dict(preset=preset, dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, sp=sp, zero=zero,
                              grad_acc=2 if pp > 1 else 1)
                out.append((name_of(layout), layout))
    return out


def name_of(layout):
    base = "-".join(f"{k}{layout[k]}" for k in ("dp", "pp", "cp", "tp"))
    extra = [f"ep{layout['ep']}"] * (layout["ep"] > 1) + ["sp"] * layout["sp"] + ["zero1"] * (layout["zero"] == 1)
    return "+".join([base] + extra)


def world_of(layout):
    return layout["dp"] * layout["pp"] * layout["cp"] * layout["tp"]


def dims_on(layout):
    on = {"dp": layout["dp"] > 1, "pp": layout["pp"] > 1, "cp": layout["cp"] > 1, "tp": layout["tp"] > 1,
          "sp": layout["sp"], "zero1": layout["zero"] == 1, "ep": layout["ep"] > 1}
    return {d for d, v in on.items() if v}


def refusal(layout):
    """validate's one sentence for a layout the configuration refuses, or None."""
    try:
        validate(Config(**{**SMALL, **layout}), any_world_size=True)
    except ConfigError as e:
        return str(e)
    return None


VARIANTS = variants()
REFUSED = {name: why for name, why in ((n, refusal(layout)) for n, layout in VARIANTS) if why}
RUNNABLE = [(name, layout) for name, layout in VARIANTS if name not in REFUSED]
DEFAULT = {"dp2-pp2-cp1-tp2+ep2+sp+zero1", "dp2-pp1-cp2-tp2+sp+zero1", "dp1-pp2-cp2-tp2+sp"}  # 8 processes each


# ------------------------------------------------------------------------------------ one variant's run
_model_child = model_child  # tests/_parity.py: one step's gradients, then the 3-step run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """reference(layout) -> the single process's (grads, records, summary) for that layout's global batch; one
    run per distinct (preset, grad_acc) in the module."""
    cache = {}

    def get(layout):
        key = (layout["preset"], layout["grad_acc"] * layout["dp"])
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ref-{key[0]}-{key[1]}")
            cache[key] = run_on_ranks(_model_child, 1, dict(preset=key[0], grad_acc=key[1]), str(out),
                                      timeout_s=180)[0]
        return cache[key]

    return get


def differences(results, reference):
    """The worst differences from the reference, measured (not just judged): gradient (max |g - g_ref| over the
    tensor's largest |g_ref|), share of assert_matches' allowance used (|g - g_ref| / (1e-7 + 1e-5 |g_ref|), a
    pass needs <= 1), and the relative differences of loss, gradient norm (worst step) and the last val loss."""
    ref_grads, ref_records, _ = reference
    grad_rel = tol_used = 0.0
    for grads, _, _ in results:
        for name, g in grads.items():
            want = ref_grads[name]
            diff = (g - want).abs()
            grad_rel = max(grad_rel, (diff.max() / want.abs().max().clamp_min(1e-30)).item())
            tol_used = max(tol_used, (diff / (1e-7 + 1e-5 * want.abs())).max().item())
    records = results[0][1]

    def rel(key, rows, ref_rows):
        return max(abs(r[key] - w[key]) / abs(w[key]) for r, w in zip(rows, ref_rows))

    return dict(grad_rel=grad_rel, grad_tol_used=tol_used, loss_rel=rel("loss", records, ref_records),
                grad_norm_rel=rel("grad_norm", records, ref_records),
                val_loss_rel=rel("val_loss", records[-1:], ref_records[-1:]))


ROWS = {}  # name -> row of the results table, this session's


def write_table():
    path = os.environ.get("PICOTRON_MATRIX_OUT")
    if not path:
        return
    order = [name for name, _ in VARIANTS]
    rows = [ROWS[n] for n in order if n in ROWS]
    meta = dict(command="PICOTRON_MATRIX_OUT=... python -m pytest tests/test_parity_matrix.py --tier=heavy",
                settings=SMALL, torch=torch.__version__, python=platform.python_version(), cpu_cores=os.cpu_count(),
                variants=len(VARIANTS), ran=sum(r["passed"] is not None for r in rows),
                passed=sum(r["passed"] is True for r in rows), refused=sum(r["passed"] is None for r in rows),
                wall_s_sum=round(sum(r["wall_s"] or 0 for r in rows), 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:  # one line per row: a table to read and to diff
        f.write('{"meta": ' + json.dumps(meta) + ',\n "rows": [\n  ' + ",\n  ".join(map(json.dumps, rows)) + "\n]}\n")


def row_of(name, layout, **kw):
    return dict(variant=name, preset=layout["preset"], layout={k: layout[k] for k in ("dp", "pp", "cp", "tp", "ep")},
                sp=layout["sp"], zero=layout["zero"], grad_acc=layout["grad_acc"], processes=world_of(layout), **kw)


def _param(name, layout):
    marks = [] if name in DEFAULT else [pytest.mark.parity_matrix]
    return pytest.param(layout, id=name, marks=marks)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("layout", [_param(n, l) for n, l in RUNNABLE])
def test_layout_matches_one_process(reference, tmp_path, layout):
    name, world = name_of(layout), world_of(layout)
    ref = reference(layout)
    start = time.perf_counter()
    recorded = run_on_ranks(nccl_rules.run_recorded, world, _model_child, layout, str(tmp_path / "run"),
                            timeout_s=600 if world > 8 else 120 + 30 * world)
    wall = time.perf_counter() - start
    results = [out for out, _ in recorded]
    verdict = nccl_rules.replay([trace for _, trace in recorded])  # every message and collective, NCCL's rules
    diffs, passed = differences(results, ref), False
    try:
        assert_matches(results, ref, name)
        assert verdict.ok, f"{name}: {verdict}"
        passed = True
    finally:
        ROWS[name] = row_of(name, layout, passed=passed, wall_s=round(wall, 1), nccl_replay=verdict.ok,
                            nccl_ops=verdict.ops, **{k: float(f"{v:.3g}") for k, v in diffs.items()})
        write_table()


def test_no_layout_is_refused():
    """Every variant of the matrix runs (experts with cp included); a refusal would be a regression."""
    assert not REFUSED, REFUSED


def test_the_matrix_is_complete():
    dense = [l for _, l in VARIANTS if l["preset"] == "tiny"]
    assert {(l["dp"], l["pp"], l["cp"], l["tp"]) for l in dense} == set(itertools.product((1, 2), repeat=4))
    assert len(dense) == 42 and len(VARIANTS) == 66 and len(RUNNABLE) == 66
    assert max(world_of(l) for _, l in RUNNABLE) == 16
    for _, layout in VARIANTS:  # every sp and ZeRO-1 choice of each layout that allows it
        assert not layout["sp"] or layout["tp"] == 2
        assert not layout["zero"] or layout["dp"] * layout["cp"] > 1


def test_default_subset_covers_every_pair():
    """Every pair of the seven dimensions is active together in some default variant, except cp with ep (in
    test_expert_parallel's default: dp2·cp2·ep2)."""
    assert DEFAULT <= {n for n, _ in RUNNABLE}
    together = set()
    for name, layout in RUNNABLE:
        if name in DEFAULT:
            together |= set(itertools.combinations(sorted(dims_on(layout)), 2))
    missing = set(itertools.combinations(sorted(DIMS), 2)) - together - {("cp", "ep")}
    assert not missing, missing
    assert max(world_of(l) for n, l in RUNNABLE if n in DEFAULT) == 8  # the 16-process runs are the heavy tier's
