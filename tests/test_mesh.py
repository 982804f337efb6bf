"""The (dp, pp, cp, tp) grid: pure coordinate/group arithmetic, then real process groups on 1, 4 and 8 ranks."""
import itertools

import pytest
import torch
import torch.distributed as dist

from picotron.launch import run_on_ranks
from picotron.mesh import ORDER, Mesh, grid_coords, grid_rank, group_ranks, pick_device

EXPECTED = {  # sizes (dp, pp, cp, tp) -> groups along each axis, written out by hand
    (2, 1, 1, 2): {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "pp": [[0], [1], [2], [3]],
                   "cp": [[0], [1], [2], [3]], ("dp", "cp"): [[0, 2], [1, 3]]},
    (1, 2, 2, 2): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                   "pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[r] for r in range(8)],
                   ("dp", "cp"): [[0, 2], [1, 3], [4, 6], [5, 7]]},
    (2, 2, 2, 1): {"tp": [[r] for r in range(8)], "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                   "pp": [[0, 2], [1, 3], [4, 6], [5, 7]], "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                   ("dp", "cp"): [[0, 1, 4, 5], [2, 3, 6, 7]]},
}


@pytest.mark.parametrize("sizes", list(EXPECTED))
def test_group_ranks_by_hand(sizes):
    for dims, groups in EXPECTED[sizes].items():
        assert group_ranks(sizes, dims) == groups, dims


def test_coords_tp_fastest():
    assert [grid_coords(r, (2, 1, 1, 2)) for r in range(4)] == [
        {"dp": 0, "pp": 0, "cp": 0, "tp": 0}, {"dp": 0, "pp": 0, "cp": 0, "tp": 1},
        {"dp": 1, "pp": 0, "cp": 0, "tp": 0}, {"dp": 1, "pp": 0, "cp": 0, "tp": 1}]
    assert grid_coords(5, {"dp": 2, "tp": 4}) == {"dp": 1, "pp": 0, "cp": 0, "tp": 1}
    assert grid_coords(6, (1, 2, 2, 2)) == {"dp": 0, "pp": 1, "cp": 1, "tp": 0}
    with pytest.raises(ValueError):
        grid_coords(4, (2, 1, 1, 2))
    with pytest.raises(ValueError):
        grid_coords(0, {"xp": 2})


@pytest.mark.parametrize("sizes", [(2, 1, 1, 2), (1, 2, 2, 2), (2, 2, 2, 1), (3, 2, 1, 2), (2, 3, 2, 2)])
def test_groups_partition_the_world(sizes):
    world = 1
    for s in sizes:
        world *= s
    assert [grid_rank(grid_coords(r, sizes), sizes) for r in range(world)] == list(range(world))
    for n in range(1, len(ORDER) + 1):
        for dims in itertools.combinations(ORDER, n):
            groups = group_ranks(sizes, dims)
            assert sorted(r for g in groups for r in g) == list(range(world))  # each rank in exactly one group
            size = 1
            for d in dims:
                size *= sizes[ORDER.index(d)]
            for g in groups:
                assert len(g) == size and g == sorted(g)
                others = {tuple(v for k, v in grid_coords(r, sizes).items() if k not in dims) for r in g}
                assert len(others) == 1  # members differ only along dims


def test_pick_device():
    assert pick_device(4, 1, device="cpu") == (torch.device("cpu"), "gloo")
    if not torch.cuda.is_available():
        assert pick_device(2, 0) == (torch.device("cpu"), "gloo")
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            pick_device(1, 0, device="cuda")
    elif torch.cuda.device_count() >= 1:
        assert pick_device(1, 0) == (torch.device("cuda", 0), "nccl")
    with pytest.raises(ValueError):
        pick_device(1, 0, device="tpu")


def _gpus(monkeypatch, n):
    """Pretend torch sees n CUDA GPUs (n = None: a CPU-only build; any other CUDA call fails the test)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n or 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) on a refused layout"))


def test_more_processes_per_node_than_gpus_is_one_sentence_never_the_cpu_in_silence(monkeypatch):
    """DESIGN: cuda + nccl with one GPU per local rank; cpu + gloo when asked or when there is no GPU; never
    silently one for the other. The node's processes are LOCAL_WORLD_SIZE (torchrun's), else the world."""
    _gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(RuntimeError) as e:
        pick_device(8, 0)
    assert str(e.value) == ("8 processes per node need 8 GPUs (one each); this node has 1: pass --device cpu to run "
                            "them on CPU with gloo, or run at most 1 process per node.")
    with pytest.raises(RuntimeError, match=r"^--device cuda with 8 processes per node needs 8 GPUs .* --device cpu"):
        pick_device(8, 7, device="cuda")  # (before: rank 7 would have asked for cuda:7 on a one-GPU machine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("a CUDA call on the CPU path"))
    assert pick_device(8, 7, device="cpu") == (torch.device("cpu"), "gloo")  # asked for: no CUDA call at all
    _gpus(monkeypatch, 8)
    assert pick_device(8, 7) == (torch.device("cuda", 7), "nccl")
    _gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 nodes of 2 processes: 2 GPUs each is enough
    assert pick_device(4, 1, device="cuda") == (torch.device("cuda", 1), "nccl")
    _gpus(monkeypatch, None)  # a CPU-only machine: gloo, without a word
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert pick_device(8, 3) == (torch.device("cpu"), "gloo")


def test_mesh_init_refuses_before_any_process_group(monkeypatch):
    """torchrun --nproc_per_node 2 on a one-GPU machine: Mesh.init says the sentence before init_process_group."""
    _gpus(monkeypatch, 1)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("a process group was made"))
    monkeypatch.setattr(dist, "rendezvous", lambda *a, **k: pytest.fail("a rendezvous was started"))
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="^2 processes per node need 2 GPUs .* pass --device cpu"):
        Mesh.init(dp=2)
    assert not dist.is_initialized()


def test_single_process_mesh_needs_no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    with Mesh.init(device="cpu") as mesh:
        assert (mesh.rank, mesh.world_size, mesh.device, mesh.backend) == (0, 1, torch.device("cpu"), "gloo")
        assert mesh.sizes == {"dp": 1, "pp": 1, "cp": 1, "tp": 1} and mesh.tp.ranks == [0]
        assert mesh.is_first_stage and mesh.is_last_stage and mesh.pp_prev_rank is None and mesh.pp_next_rank is None
        x = torch.ones(3)
        dist.all_reduce(x, group=mesh.dp_cp.group)
        assert x.tolist() == [1.0, 1.0, 1.0]
        assert "rank 0/1" in repr(mesh)
    assert not dist.is_initialized()


def test_mesh_without_launcher_refuses_several_ranks(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="needs 2 processes"):
        Mesh.init(dp=2, device="cpu")
    assert not dist.is_initialized()


def _all_reduce_each_group(sizes):
    """On every rank: sum the global rank over each of this rank's groups; return what the mesh reports."""
    mesh = Mesh.init(**dict(zip(ORDER, sizes)))
    sums = {}
    for name in ("dp", "pp", "cp", "tp", "dp_cp"):
        x = torch.tensor([float(mesh.rank)])
        getattr(mesh, name).all_reduce(x)  # the axis's own collective...
        y = torch.tensor([float(mesh.rank)])
        dist.all_reduce(y, group=getattr(mesh, name).group)  # ...and torch's, on the axis's group
        assert x.item() == y.item()
        sums[name] = x.item()
    peers = {n: getattr(mesh, n).ranks for n in ("dp", "pp", "cp", "tp", "dp_cp")}
    info = {"sums": sums, "coords": mesh.coords, "peers": peers, "prev": mesh.pp_prev_rank,
            "next": mesh.pp_next_rank, "first": mesh.is_first_stage, "last": mesh.is_last_stage,
            "ranks": {n: getattr(mesh, n).rank for n in ("dp", "pp", "cp", "tp", "dp_cp")},
            "sizes": {n: getattr(mesh, n).size for n in ("dp", "pp", "cp", "tp", "dp_cp")},
            "backend": mesh.backend, "device": str(mesh.device), "repr": repr(mesh)}
    mesh.destroy()
    assert dist.is_initialized()  # the world group belongs to run_on_ranks, not to the mesh
    return info


@pytest.mark.parametrize("sizes", [(2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (2, 2, 2, 1)])
def test_real_mesh_all_reduce_over_each_group(sizes):
    world = sizes[0] * sizes[1] * sizes[2] * sizes[3]
    infos = run_on_ranks(_all_reduce_each_group, world, sizes)
    for rank, info in enumerate(infos):
        assert info["coords"] == grid_coords(rank, sizes)
        assert info["backend"] == "gloo" and info["device"] == "cpu"
        for name, dims in [("dp", "dp"), ("pp", "pp"), ("cp", "cp"), ("tp", "tp"), ("dp_cp", ("dp", "cp"))]:
            (mine,) = [g for g in group_ranks(sizes, dims) if rank in g]
            assert info["peers"][name] == mine
            assert info["sums"][name] == sum(mine), (rank, name)
            assert info["ranks"][name] == mine.index(rank) and info["sizes"][name] == len(mine)
        pp_rank, pp = info["coords"]["pp"], sizes[1]
        assert info["first"] == (pp_rank == 0) and info["last"] == (pp_rank == pp - 1)
        assert info["prev"] == (None if pp_rank == 0 else grid_rank({**info["coords"], "pp": pp_rank - 1}, sizes))
        assert info["next"] == (None if pp_rank == pp - 1 else grid_rank({**info["coords"], "pp": pp_rank + 1}, sizes))


def test_dp2_tp2_expected_sums():
    """The spec's example: 4 ranks, dp=2 tp=2. tp groups {0,1},{2,3}; dp groups {0,2},{1,3}."""
    infos = run_on_ranks(_all_reduce_each_group, 4, (2, 1, 1, 2))
    assert [i["sums"]["tp"] for i in infos] == [1, 1, 5, 5]
    assert [i["sums"]["dp"] for i in infos] == [2, 4, 2, 4]
    assert [i["sums"]["dp_cp"] for i in infos] == [2, 4, 2, 4]
    assert [i["sums"]["pp"] for i in infos] == [0, 1, 2, 3]
    assert "grid dp=2 pp=1 cp=1 tp=2" in infos[3]["repr"] and "coords dp=1 pp=0 cp=0 tp=1" in infos[3]["repr"]


def _mesh_from_env():
    """Without a process group: Mesh.init must build the world itself from torchrun-style variables."""
    assert not dist.is_initialized()
    mesh = Mesh.init(pp=2, device="cpu", timeout_s=300)  # a hang guard
    x = torch.tensor([mesh.rank + 1.0])
    dist.all_reduce(x, group=mesh.pp.group)
    out = (mesh.rank, mesh.world_size, x.item(), mesh.pp_next_rank, mesh.pp_prev_rank)
    mesh.destroy()
    assert not dist.is_initialized()
    return out


def test_mesh_init_from_env():
    assert run_on_ranks(_mesh_from_env, 2, init_group=False) == [(0, 2, 3.0, 1, None), (1, 2, 3.0, None, 0)]


def _wrong_world():
    Mesh.init(dp=3)


def test_mesh_size_must_match_world():
    from picotron.launch import RankError

    with pytest.raises(RankError, match="does not match the 2 running processes"):
        run_on_ranks(_wrong_world, 2)
