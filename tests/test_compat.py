"""picotron/compat.py: the torch floor is refused in one sentence at `import picotron`, and the renamed collectives
are found under whichever name the `ops` at hand offers (torch.distributed of any release, ours, an emulated link)."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from picotron import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("version, release", [("2.4.1+cu121", (2, 4)), ("2.13.0+cpu", (2, 13)), ("2.10", (2, 10)),
                                              ("2.5.0a0+git3bcc3cd", (2, 5)), ("3.0.0.dev20270101", (3, 0))])
def test_release_reads_major_and_minor(version, release):
    assert compat._release(version) == release


def test_a_torch_older_than_the_floor_is_refused_in_one_sentence():
    floor = compat.FLOOR_TEXT
    older = f"{compat.FLOOR[0]}.{compat.FLOOR[1] - 1}.1"
    with pytest.raises(ImportError) as e:
        compat.require_torch(older)
    assert str(e.value) == (f"picotron needs torch >= {floor} (found {older}): pip install 'torch>={floor}' "
                            f"(or a pod image whose torch is {floor} or newer).")
    compat.require_torch(f"{floor}.0")  # the floor itself, a pre-release of it (an NGC image's) and anything newer
    compat.require_torch(f"{floor}.0a0+git3bcc3cd")
    compat.require_torch("3.0.0")


def test_the_installed_torch_passes():
    compat.require_torch()
    import torch

    assert compat._release(torch.__version__) >= compat.FLOOR


def test_import_picotron_refuses_an_old_torch_before_anything_else():
    """The real thing: a fresh interpreter whose installed torch reports 2.3.1 stops at `import picotron` (which is
    also the command line's first step, before any process group) with the sentence as the last line."""
    code = ("import importlib.metadata as m\n"
            "real = m.version\n"
            "m.version = lambda name: '2.3.1' if name == 'torch' else real(name)\n"
            "try:\n"
            "    import picotron\n"
            "except ImportError:\n"
            "    import sys\n"
            "    print('torch imported:', 'torch' in sys.modules)\n"
            "    raise\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"ImportError: picotron needs torch >= {compat.FLOOR_TEXT} (found 2.3.1): pip install "
        f"'torch>={compat.FLOOR_TEXT}' (or a pod image whose torch is {compat.FLOOR_TEXT} or newer)."), r.stderr
    assert r.stdout.strip() == "torch imported: False", r.stdout  # refused before torch (or anything) was imported


def test_the_floor_is_one_number_everywhere():
    """compat.FLOOR, requirements.txt's torch>= and the torch CI pins for the smoke subset say the same release."""
    import re

    reqs = open(os.path.join(ROOT, "requirements.txt")).read()
    assert re.findall(r"^torch>=(\S+)$", reqs, re.M) == [compat.FLOOR_TEXT], "requirements.txt's torch>= is not FLOOR"
    ci = open(os.path.join(ROOT, ".ci", "smoke-oldtorch")).read()
    pins = re.findall(r"^TORCH=(\S+)", ci, re.M)
    assert len(pins) == 1 and compat._release(pins[0]) == compat.FLOOR, f".ci/smoke-oldtorch pins {pins}, not FLOOR"


def test_every_line_of_the_smoke_subset_names_a_test():
    """tests/smoke_oldtorch.txt (what CI runs on the floor's torch) cannot rot: each entry's file and function exist,
    and it covers every strategy."""
    import re

    entries = [line.split("#")[0].strip() for line in open(os.path.join(ROOT, "tests", "smoke_oldtorch.txt"))]
    entries = [e for e in entries if e]
    assert 15 <= len(entries) <= 40, len(entries)
    for entry in entries:
        path, _, name = entry.partition("::")
        text = open(os.path.join(ROOT, path)).read()
        if name:
            assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", text, re.M), f"{entry}: no such test"
    for module in ("data_parallel", "zero", "tensor_parallel", "pipeline_parallel", "context_parallel",
                   "expert_parallel", "checkpoint", "train", "model", "lesson"):
        assert any(f"tests/test_{module}" in e for e in entries), f"the smoke subset has no test of {module}"


def test_collective_prefers_the_newer_name_where_there_is_one():
    def old(*a, **k):
        return "old"

    def new(*a, **k):
        return "new"

    both = SimpleNamespace(all_gather_into_tensor=old, all_gather_single=new, reduce_scatter_tensor=old,
                           reduce_scatter_single=new, all_reduce=old)
    only_old = SimpleNamespace(all_gather_into_tensor=old, reduce_scatter_tensor=old)
    assert compat.collective(both, "all_gather_into_tensor")() == "new"
    assert compat.collective(both, "reduce_scatter_tensor")() == "new"
    assert compat.collective(both, "all_reduce")() == "old"  # not renamed: itself
    assert compat.collective(only_old, "all_gather_into_tensor")() == "old"
    with pytest.raises(AttributeError):
        compat.collective(only_old, "all_to_all_single")


def test_every_ops_the_mesh_uses_offers_the_tensor_collectives():
    """torch.distributed (this torch, whatever its release), ours, an emulated link's: each has one of the names."""
    import torch.distributed as dist

    from picotron import collectives as ours
    from picotron.link import EmulatedLink

    for ops in (dist, ours, EmulatedLink(1e9).ops(dist)):
        for name in compat.RENAMED:
            assert callable(compat.collective(ops, name)), (ops, name)


def _axis_collectives(impl, link):
    """Every collective of a mesh axis (dp = 2), sync and async, on torch's or our collectives, optionally held to
    an emulated link: what each rank got, and the FutureWarnings raised (torch 2.13 deprecated the old names)."""
    import warnings

    import torch

    from picotron.link import EmulatedLink
    from picotron.mesh import Mesh

    with warnings.catch_warnings(record=True) as caught, Mesh.init(dp=2, collectives=impl) as mesh:
        warnings.simplefilter("always")
        axis = mesh.over(EmulatedLink(1e9)).dp if link else mesh.dp
        r = axis.rank
        t = torch.arange(4.0) + 10 * r
        gathered = torch.empty(8)
        axis.all_gather_into(gathered, t)
        scattered = torch.empty(2)
        axis.reduce_scatter_into(scattered, t.clone(), async_op=True).wait()
        summed = t.clone()
        axis.all_reduce(summed)
        sent = t.clone()
        axis.broadcast(sent, 1)  # from the axis's rank 1
        results = [gathered, scattered, summed, sent]
        if not link:  # the emulated link models what the dense strategies send (no all-to-all)
            swapped = torch.empty(4)
            axis.all_to_all_into(swapped, t)
            results.append(swapped)
        deprecated = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        return [x.tolist() for x in results], deprecated


@pytest.mark.parametrize("impl,link", [("torch", False), ("ours", False), ("torch", True)])
def test_every_axis_collective_runs_on_this_torch(impl, link):
    """The calls that raised AttributeError on a pod's torch 2.11 (ZeRO, sp, cp's all-gather, the tp sample): each
    axis collective on 2 ranks, torch's and ours, and through an emulated link, with the right values and no
    deprecation warning."""
    from picotron.launch import run_on_ranks

    got = run_on_ranks(_axis_collectives, 2, impl, link)
    want = [[[0, 1, 2, 3, 10, 11, 12, 13], [10, 12], [10, 12, 14, 16], [10, 11, 12, 13], [0, 1, 10, 11]],
            [[0, 1, 2, 3, 10, 11, 12, 13], [14, 16], [10, 12, 14, 16], [10, 11, 12, 13], [2, 3, 12, 13]]]
    assert [values for values, _ in got] == [w[:4] if link else w for w in want]
    assert got[0][1] == got[1][1] == []
