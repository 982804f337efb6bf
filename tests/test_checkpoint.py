"""Checkpoints: the index, resharding between layouts (the same parameters and Adam state, element for element),
training that goes on at another layout, atomic and asynchronous writes, keeping the last k, export."""
import json
import os
import shutil

import pytest
import torch

from picotron import checkpoint, nccl_rules, reshard
from picotron.config import Config
from picotron.launch import run_on_ranks
from picotron.mesh import Mesh
from picotron.metrics import read_metrics
from picotron.parallelize import parallelize, validate
from picotron.train import train

SMALL = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=0, lr=3e-3,
             warmup_steps=2, grad_clip=1.0)


def _degrees(cfg):
    return dict(dp=cfg.dp, pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep)


def _train(layout, out, steps, save_every=0, resume=False, **kw):
    """Child: train `steps` steps at `layout`, saving every `save_every`; rank 0 returns the metrics records."""
    cfg = Config(out=out, steps=steps, save_every=save_every, resume=resume, **{**SMALL, **layout, **kw})
    with Mesh.init(**_degrees(cfg)) as mesh:
        train(cfg, mesh)
        return read_metrics(out)[0] if mesh.rank == 0 else None


def _reshard(layout, src, out):
    """Child: build `layout`, load the checkpoint `src` (written at any layout), save it again at this layout."""
    cfg = Config(out=out, **{**SMALL, **layout})
    with Mesh.init(**_degrees(cfg)) as mesh:
        run = parallelize(cfg, mesh)
        step = reshard.load(src, run, mesh)
        saver = checkpoint.Saver(out, cfg, mesh)
        saver.save(step, run)
        saver.close()
        return step


def rewind(out, step):
    """Make the run in `out` look stopped after `step`: its later checkpoints removed, `latest` pointing at step's
    (the learning-rate schedule depends on --steps, so a run that is to be resumed is run with the final --steps)."""
    root = os.path.join(out, "checkpoints")
    for name in os.listdir(root):
        if name.startswith("step_") and int(name.split("_")[1]) > step:
            shutil.rmtree(os.path.join(root, name))
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(f"step_{step:06d}")


def world(layout):
    return layout.get("dp", 1) * layout.get("pp", 1) * layout.get("cp", 1) * layout.get("tp", 1)


def assert_same_state(a, b, label):
    """Two consolidated checkpoints hold the same step, parameters and optimizer state, bit for bit."""
    assert a["step"] == b["step"], label
    assert set(a["params"]) == set(b["params"]), f"{label}: {set(a['params']) ^ set(b['params'])}"
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"{label}: parameter {name} differs"
        assert a["optimizer"][name].keys() == b["optimizer"][name].keys(), f"{label}: {name}"
        for kind, v in a["optimizer"][name].items():
            w = b["optimizer"][name][kind]
            assert (torch.equal(v, w) if torch.is_tensor(v) else v == w), f"{label}: {name} {kind} differs"


# (written at, loaded and written again at): every strategy on one side or the other, ZeRO 1/2/3 both ways. The
# default run keeps four (every strategy, ZeRO-1 and ZeRO-3, sharded -> replicated and back); --heavy runs all seven.
PAIRS = [
    ("dp2-tp2-pp2+zero1 -> tp4", dict(dp=2, tp=2, pp=2, zero=1, grad_acc=2), dict(tp=4)),
    ("dp4+zero3 -> 1", dict(dp=4, zero=3), dict()),
    ("cp2-pp2 -> dp2", dict(cp=2, pp=2, grad_acc=2), dict(dp=2)),
    ("1 -> dp2-tp2+zero3", dict(), dict(dp=2, tp=2, zero=3)),
    ("tp2+sp+dp2+zero2 -> pp2 interleaved", dict(tp=2, sp=True, dp=2, zero=2),
     dict(pp=2, pp_schedule="interleaved", pp_chunks=2, grad_acc=2)),
    ("moe dp2-ep2+zero1 -> moe tp2", dict(preset="tiny-moe", dp=2, ep=2, zero=1), dict(preset="tiny-moe", tp=2)),
    ("tied pp2 -> tied dp2+zero1", dict(pp=2, grad_acc=2, tie_word_embeddings=True),
     dict(dp=2, zero=1, tie_word_embeddings=True)),
]
HEAVY_PAIRS = {"dp2-tp2-pp2+zero1 -> tp4", "dp4+zero3 -> 1", "tp2+sp+dp2+zero2 -> pp2 interleaved"}


@pytest.mark.parametrize("label,src,dst", [pytest.param(*p, marks=pytest.mark.heavy) if p[0] in HEAVY_PAIRS else p
                                           for p in PAIRS], ids=[p[0] for p in PAIRS])
def test_reshard_round_trip_keeps_every_value(tmp_path, label, src, dst):
    """Train 2 steps at `src`, save; load at `dst` and save again: both checkpoints, consolidated, are equal bit
    for bit (parameters, Adam's moments and step), and every element was written exactly once."""
    for layout in (src, dst):  # layouts the command line accepts
        validate(Config(**{**SMALL, **layout}), any_world_size=True)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_on_ranks(_train, world(src), src, a, 2, 2, timeout_s=240)
    step = run_on_ranks(_reshard, world(dst), dst, checkpoint.latest(a), b, timeout_s=240)[0]
    assert step == 2
    first, second = reshard.consolidate(checkpoint.latest(a)), reshard.consolidate(checkpoint.latest(b))
    assert_same_state(first, second, label)
    assert all(v["step"] == 2.0 for v in first["optimizer"].values())
    for folder in (checkpoint.latest(a), checkpoint.latest(b)):  # no element written twice
        written = sum(torch.Size(e["box"] if e["flat"] is None else [e["flat"][1] - e["flat"][0]]).numel()
                      for r in reshard.Reader(folder).ranks for e in r["slices"])
        assert written == sum(p.numel() for p in first["params"].values()), folder


def test_training_goes_on_at_another_layout(tmp_path):
    """6 steps at dp2·tp2 with ZeRO-1; the same run resumed from its step-3 checkpoint at pp2 (1F1B over the same
    global batch) ends with the uninterrupted run's losses, to the parity tolerance (sums in another order)."""
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    src = dict(dp=2, tp=2, zero=1, grad_acc=1)
    ref = run_on_ranks(_train, 4, src, full, 6, timeout_s=240)[0]
    run_on_ranks(_train, 4, src, cut, 6, 3, timeout_s=240)
    rewind(cut, 3)
    resumed = run_on_ranks(_train, 2, dict(pp=2, grad_acc=2), cut, 6, 3, True, timeout_s=240)[0]
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed[:3]] == [r["loss"] for r in ref[:3]]  # kept from the first run
    assert [r["loss"] for r in resumed[3:]] == pytest.approx([r["loss"] for r in ref[3:]], rel=1e-5)
    assert [r["grad_norm"] for r in resumed[3:]] == pytest.approx([r["grad_norm"] for r in ref[3:]], rel=1e-5)


def test_same_layout_resume_is_bit_for_bit_and_async_writes_the_same(tmp_path):
    """dp2 + ZeRO-2: resuming from the step-2 checkpoint gives the uninterrupted losses exactly; an asynchronous
    writer writes the same checkpoint as the synchronous one; only the newest `keep` checkpoints remain."""
    layout = dict(dp=2, zero=2)
    sync, cut, asyn = (str(tmp_path / n) for n in ("sync", "cut", "async"))
    ref = run_on_ranks(_train, 2, layout, sync, 5, 1, keep_checkpoints=2, timeout_s=240)[0]
    run_on_ranks(_train, 2, layout, cut, 5, 2, timeout_s=240)
    rewind(cut, 2)
    resumed = run_on_ranks(_train, 2, layout, cut, 5, 0, True, timeout_s=240)[0]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in ref]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in ref]
    run_on_ranks(_train, 2, layout, asyn, 5, 1, async_save=True, keep_checkpoints=2, timeout_s=240)
    for out in (sync, asyn):
        kept = sorted(os.listdir(os.path.join(out, "checkpoints")))
        assert kept == ["latest", "step_000004", "step_000005"], kept
    assert_same_state(reshard.consolidate(checkpoint.latest(sync)), reshard.consolidate(checkpoint.latest(asyn)),
                      "async vs sync")


def test_index_says_where_each_slice_sits(tmp_path):
    """tp2 + ZeRO-1 over dp2: a row-parallel weight's index entry names its box in the full tensor and the flat
    range of it the rank's optimizer piece holds; the value there is the consolidated tensor's."""
    out = str(tmp_path / "run")
    run_on_ranks(_train, 4, dict(dp=2, tp=2, zero=1), out, 1, 1, timeout_s=240)
    folder = checkpoint.latest(out)
    reader = reshard.Reader(folder)
    full = reshard.consolidate(folder)["params"]["layers.0.mlp.down_proj.weight"]  # [128, 384]: split on dim 1
    entries = [(r["rank"], e) for r in reader.ranks for e in r["slices"] if e["name"] == "layers.0.mlp.down_proj.weight"]
    boxes = sorted({(tuple(e["offsets"]), tuple(e["box"])) for _, e in entries})
    assert boxes == [((0, 0), (128, 192)), ((0, 192), (128, 192))]
    for rank, e in entries:
        value = reader.file(rank)["tensors"][f"{e['key']}.value"]
        s = checkpoint.Slice(e["name"], tuple(e["shape"]), tuple(e["offsets"]), tuple(e["box"]),
                             None if e["flat"] is None else tuple(e["flat"]))
        assert torch.equal(s.cut(full), value.reshape(-1) if s.flat else value)
    assert json.load(open(os.path.join(folder, "config.json")))["zero"] == 1


def test_a_missing_rank_file_is_named(tmp_path):
    out = str(tmp_path / "run")
    run_on_ranks(_train, 2, dict(dp=2, zero=1), out, 1, 1, timeout_s=240)
    folder = checkpoint.latest(out)
    os.remove(os.path.join(folder, "rank_00001.json"))
    with pytest.raises(FileNotFoundError, match="written by 2 ranks but holds 1 index"):
        reshard.consolidate(folder)


@pytest.mark.parametrize("preset,layout", [("tiny", dict(dp=2, tp=2, zero=1)), ("tiny-moe", dict(dp=2, ep=2, zero=2))],
                         ids=["llama dp2-tp2+zero1", "mixtral dp2-ep2+zero2"])
def test_export_from_any_layout_loads_in_transformers(tmp_path, preset, layout):
    """A checkpoint written by 4 or 2 ranks, exported by `python -m picotron.export`, loads with transformers'
    AutoModelForCausalLM (Llama or Mixtral); its logits equal ours on the consolidated weights (fp32, 1e-5)."""
    from transformers import AutoModelForCausalLM

    from picotron import export
    from picotron.model import Llama

    out = str(tmp_path / "run")
    run_on_ranks(_train, world(layout), dict(preset=preset, **layout), out, 2, 2, timeout_s=240)
    assert export.main([out, str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    whole = reshard.consolidate(checkpoint.latest(out))
    ours = Llama(Config(preset=preset).model_config())
    ours.load_state_dict(whole["params"], strict=False)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    assert export.main([str(tmp_path / "nothing"), str(tmp_path / "hf2")]) == 2


# ------------------------------------------------------------------- several nodes: one checkpoint folder for all
def _own_folder_each(outs, resume):
    """Child: rank r trains with --out outs[r], as ranks on nodes without a shared filesystem see the same path;
    returns (exit code, message) of the run's stop on this rank."""
    from picotron.messages import Stopped

    with Mesh.init(dp=2) as mesh:
        cfg = Config(out=outs[mesh.rank], dp=2, steps=3, save_every=1, resume=resume, **SMALL)
        try:
            train(cfg, mesh)
        except Stopped as e:
            return e.code, str(e)
        return None


def test_resume_takes_rank_0s_step_and_every_rank_must_see_its_folder(tmp_path):
    """Rank 0 reads `latest` and sends the step; a rank that does not see that folder stops EVERY rank with one
    sentence (before: each rank read its own `latest`; one that saw another step, or none, trained on from there
    while the others resumed from theirs)."""
    a, b = tmp_path / "node0", tmp_path / "node1"
    for out, step in ((a, 2), (b, 5)):  # rank 1's own `latest` names another step: rank 0's step wins
        os.makedirs(out / "checkpoints" / f"step_{step:06d}")
        (out / "checkpoints" / "latest").write_text(f"step_{step:06d}")
    results = run_on_ranks(_own_folder_each, 2, [str(a), str(b)], True, timeout_s=120)
    assert [code for code, _ in results] == [2, 2]
    assert results[0][1] == (f"picotron: error: rank 1 does not see {a}/checkpoints/step_000002 that rank 0 resumes "
                             f"from: every node must see the same checkpoint folder (a shared filesystem), or copy "
                             f"it there.")


def test_every_rank_must_see_the_checkpoint_folder_rank_0_writes(tmp_path):
    """Each rank writes its file into OUT and rank 0 commits the folder: checked once at start-up, one sentence on
    every rank instead of a checkpoint that lacks the other nodes' files."""
    a, b = tmp_path / "node0", tmp_path / "node1"
    results = run_on_ranks(_own_folder_each, 2, [str(a), str(b)], False, timeout_s=120)
    assert [code for code, _ in results] == [2, 2]
    assert results[0][1] == (f"picotron: error: rank 1 does not see the files rank 0 writes in {a}/checkpoints: every "
                             f"node must write its checkpoints to the same folder (a shared filesystem); pass an --out "
                             f"that every node sees.")
    assert os.listdir(a / "checkpoints") == []  # the probe is gone
    assert checkpoint._who([4, 5, 6, 7]) == "ranks 4, 5, 6 and 7 do" and checkpoint._who(list(range(9))) == \
        "ranks 0, 1, 2 and 6 more do"


# --------------------------------------------------------------- two levels: the nodes' disks, then the shared folder
LEVELS = dict(dp=2, ranks_per_node=1, local_save_every=1)  # two "nodes" of one rank each; level 2 every 4 steps


def _train_levels(out, resume):
    """Child: 6 steps of dp2 with both levels, every message and collective recorded (picotron.nccl_rules); returns
    ((rank 0: the metrics records and what the run printed), this rank's trace)."""
    import contextlib
    import io

    from picotron import nccl_rules

    text = io.StringIO()
    with contextlib.redirect_stdout(text), nccl_rules.Recorder() as rec:
        records = _train(LEVELS, out, 6, 4, resume)
    return (records, text.getvalue()), rec.trace


def _levels_run(out, resume):
    """Rank 0's (records, printed text), once the run's traces replay under NCCL's rules: the level-1 writes' ring
    of peer copies, the agreement on the resume step (an all-gather) and the shards sent back to a lost node."""
    results = run_on_ranks(_train_levels, 2, out, resume, timeout_s=240)
    verdict = nccl_rules.replay([trace for _, trace in results])
    assert verdict.ok, verdict
    mine = {(e["op"], e["where"].split(" ")[-1]) for _, t in results for e in t["events"] if "where" in e}
    return results[0][0], mine


def test_level_1_resumes_exactly_from_the_peers_copy_else_level_2(tmp_path):
    """dp2 as two nodes, level 1 every step, level 2 every 4: after 6 steps each node holds level-1 steps 3 and 5
    (4 and 6 are level 2's), its rank's shard and the other node's rank's copy. Rewound to step 4's level 2 with
    node 1's folder deleted (a lost node), the run resumes from level 1's step 5 (newer), rank 1's shard sent back
    from node 0's copy (and node 1's folder filled again: rank 1's shard, rank 0's copy); with both folders deleted,
    from level 2's step 4. Each time the losses after the resume, and the final checkpoint, are the uninterrupted
    run's bit for bit, and every rank's messages obey NCCL's rules. (A resume from a rank's own copy: tests/test_faults.py, after a real kill.)"""
    out = str(tmp_path / "run")
    (ref, _), ops = _levels_run(out, False)
    assert {("isend", "_transfer"), ("irecv", "_transfer")} <= ops, ops  # the peer copies (dp2 sends nothing else)
    final = reshard.consolidate(checkpoint.latest(out))
    local = tmp_path / "run" / "local"
    assert sorted(os.listdir(local / "node_000")) == sorted(os.listdir(local / "node_001")) == \
        ["step_000003", "step_000005"]
    assert sorted(os.listdir(local / "node_001" / "step_000005")) == [  # its own, and node 0's rank's copy
        "rank_00000.json", "rank_00000.pt", "rank_00001.json", "rank_00001.pt"]
    for lost, line in ((("node_001",), "resuming from level 1 (node-local) step 5, rank 1 from the next node's copy "
                                       "at step 6"),
                       (("node_000", "node_001"), f"resuming from {checkpoint.step_dir(out, 4)} at step 5")):
        rewind(out, 4)
        for node in lost:
            shutil.rmtree(local / node)
        (records, printed), ops = _levels_run(out, True)
        assert ("all_gather", "agreed_local") in ops, ops  # the agreement was replayed
        if len(lost) == 1:  # the shard sent back to the lost node (step 6 writes level 2 only: no peer copy)
            assert {("isend", "_transfer"), ("irecv", "_transfer")} <= ops, ops
        assert line in printed, printed
        assert [r["loss"] for r in records] == [r["loss"] for r in ref], lost
        assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in ref], lost
        assert_same_state(reshard.consolidate(checkpoint.latest(out)), final, f"lost {lost}")
        if lost == ("node_001",):  # the lost node's shard is back on its disk, and its copy of node 0's rank
            assert sorted(os.listdir(local / "node_001" / "step_000005")) == [
                "rank_00000.json", "rank_00000.pt", "rank_00001.json", "rank_00001.pt"]
