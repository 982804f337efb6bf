"""The process grid: every rank is one cell of a 4-D grid (dp, pp, cp, tp), and talks along its axes.

Each parallel strategy only ever talks to the ranks that differ from it in ONE coordinate: tensor-parallel
peers share dp, pp and cp and differ in tp, and so on. So the world is laid out as a grid and, for every
axis, the ranks along that axis get their own process group (plus dp x cp together, the ranks that hold
the same parameters and average their gradients). Rank numbers follow row-major order, tp fastest:

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

Why tp is fastest-varying: launchers give consecutive ranks to the GPUs of one node, and tensor parallelism
is the chattiest strategy (two all-reduces of activations per layer, forward and backward, on the critical
path), so its peers must sit on the same node with the fast links (NVLink). Context parallelism passes K/V
blocks every layer (next fastest), pipeline parallelism sends one activation per micro-batch and stage, and
data parallelism all-reduces gradients once per step, overlapped with backward: it can cross nodes.

An 8-rank grid, dp=2 pp=2 cp=1 tp=2 (two nodes of four GPUs):

                     pp stage 0         pp stage 1
    dp replica 0    [ 0 | 1 ]  ----->  [ 2 | 3 ]       node 0
    dp replica 1    [ 4 | 5 ]  ----->  [ 6 | 7 ]       node 1
                      tp  tp             tp  tp

    tp groups  {0,1} {2,3} {4,5} {6,7}    neighbours on one node: the fastest links
    pp groups  {0,2} {1,3} {4,6} {5,7}    activations flow stage 0 -> stage 1
    dp groups  {0,4} {1,5} {2,6} {3,7}    same shard of the model, different data: across nodes

Expert parallelism does not add a dimension: it carves its `ep` axis out of dp. The dp ranks are cut into
blocks of ep consecutive dp coordinates; the ranks of a block hold different experts and exchange tokens
(`ep`), and the ranks at the same place in every block (and every cp rank) hold the same experts (`edp`,
where expert gradients are summed). With dp=4, ep=2 (pp=cp=tp=1): ep groups {0,1} {2,3}, edp groups {0,2} {1,3}.

HSDP (hybrid sharded data parallelism, `--dp-shard n`) cuts dp the same way, for ZeRO: the dp ranks are cut into
blocks of n consecutive dp coordinates; a block, with every cp rank, is one SHARD group (`dp_shard`: ZeRO's units are
cut over it, its ranks hold different shards), and the ranks at the same place in every block (same cp) form a
REPLICATE group (`dp_replicate`: they hold the same shard and all-reduce its gradient). On two nodes of four GPUs,
dp=8, dp_shard=4:

    dp coordinate      0   1   2   3  |  4   5   6   7
    shard groups     [ 0   1   2   3 ]|[ 4   5   6   7 ]      within a node: the fast links carry the most bytes
    replicate groups   {0,4} {1,5} {2,6} {3,7}                 across nodes: 1/4 of the gradient, once a step

With dp_shard = 0 (or dp) there is one block: `dp_shard` is dp x cp itself and `dp_replicate` has one rank.

The pure functions (`grid_coords`, `grid_rank`, `group_ranks`, `expert_groups`, `shard_groups`) need no processes and are what the tests and
lessons use to reason about layouts; `Mesh.init` turns them into real `torch.distributed` groups.
"""
import copy
import gc
import itertools
import math
from datetime import timedelta

import torch
import torch.distributed as dist

from picotron import launch, p2p
from picotron.compat import collective
from picotron.rules import device_problem  # the rule, without torch for --device cpu: picotron.rules

ORDER = ("dp", "pp", "cp", "tp")  # slowest- to fastest-varying


def _as_sizes(sizes):
    """Accept {"dp": 2, "tp": 2} (missing axes are 1) or a tuple in ORDER like (2, 1, 1, 2)."""
    if isinstance(sizes, dict):
        unknown = set(sizes) - set(ORDER)
        if unknown:
            raise ValueError(f"unknown grid axes {sorted(unknown)}; the axes are {ORDER}.")
        return {d: int(sizes.get(d, 1)) for d in ORDER}
    sizes = tuple(sizes)
    if len(sizes) != len(ORDER):
        raise ValueError(f"sizes {sizes} must have one entry per axis {ORDER}.")
    return dict(zip(ORDER, (int(s) for s in sizes)))


def grid_coords(rank, sizes):
    """Coordinates of `rank` on the grid, e.g. grid_coords(5, (2, 1, 1, 4)) == {dp: 1, pp: 0, cp: 0, tp: 1}."""
    sizes = _as_sizes(sizes)
    if not 0 <= rank < math.prod(sizes.values()):
        raise ValueError(f"rank {rank} is outside a grid of {math.prod(sizes.values())} ranks.")
    coords = {}
    for d in reversed(ORDER):  # peel off the fastest axis first
        rank, coords[d] = divmod(rank, sizes[d])
    return {d: coords[d] for d in ORDER}


def grid_rank(coords, sizes):
    """The inverse of grid_coords: the global rank at `coords` (missing axes are 0)."""
    sizes, rank = _as_sizes(sizes), 0
    for d in ORDER:
        rank = rank * sizes[d] + coords.get(d, 0)
    return rank


def group_ranks(sizes, dims):
    """The process groups along `dims` ("tp", or ("dp", "cp") for a combined group), as lists of ranks.

    Ranks that agree on every OTHER axis form one group. Groups come out ordered by their lowest rank and
    each list is ascending, so every process computes exactly the same list (new_group needs that).
    group_ranks((2, 1, 1, 2), "tp") == [[0, 1], [2, 3]];  group_ranks((2, 1, 1, 2), "dp") == [[0, 2], [1, 3]]
    """
    sizes = _as_sizes(sizes)
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    if not set(dims) <= set(ORDER):
        raise ValueError(f"unknown grid axes {dims}; the axes are {ORDER}.")
    groups = {}
    for rank in range(math.prod(sizes.values())):
        c = grid_coords(rank, sizes)
        groups.setdefault(tuple(c[d] for d in ORDER if d not in dims), []).append(rank)
    return list(groups.values())


def expert_groups(sizes, ep):
    """(ep groups, edp groups) as lists of ranks: ep = blocks of ep consecutive dp coordinates (same pp, cp,
    tp); edp = the same place in every block, with every cp rank (same pp, tp). ep must divide dp."""
    sizes = _as_sizes(sizes)
    if sizes["dp"] % ep:
        raise ValueError(f"ep={ep} does not divide dp={sizes['dp']}.")
    ep_groups = [ranks[j:j + ep] for ranks in group_ranks(sizes, "dp") for j in range(0, sizes["dp"], ep)]
    edp_groups = []
    for ranks in group_ranks(sizes, ("dp", "cp")):
        for e in range(ep):
            edp_groups.append([r for r in ranks if grid_coords(r, sizes)["dp"] % ep == e])
    return sorted(ep_groups), sorted(edp_groups)


def shard_groups(sizes, dp_shard):
    """(shard groups, replicate groups) of HSDP as lists of ranks: a shard group = a block of dp_shard consecutive dp
    coordinates with every cp rank (same pp, tp); a replicate group = the same place in every block (same pp, cp,
    tp). dp_shard must divide dp; 0 means dp (one block). With dp=4, dp_shard=2 (pp=cp=tp=1): shard groups {0,1}
    {2,3}, replicate groups {0,2} {1,3}."""
    sizes = _as_sizes(sizes)
    n = dp_shard or sizes["dp"]
    if sizes["dp"] % n:
        raise ValueError(f"dp_shard={n} does not divide dp={sizes['dp']}.")
    shard, replicate = [], []
    for ranks in group_ranks(sizes, ("dp", "cp")):
        block_of = {r: grid_coords(r, sizes)["dp"] // n for r in ranks}
        shard += [[r for r in ranks if block_of[r] == b] for b in range(sizes["dp"] // n)]
    for ranks in group_ranks(sizes, "dp"):
        replicate += [[r for r in ranks if grid_coords(r, sizes)["dp"] % n == j] for j in range(n)]
    return sorted(shard), sorted(replicate)


def pick_device(world_size=1, local_rank=0, device=None, per_node=None):
    """(torch.device, backend): one GPU per process with NCCL, or CPU with gloo (asked for, or no GPU at all).

    `device` forces "cpu" or "cuda"; None/"auto" decides: cuda when torch sees a GPU, cpu when it sees none.
    The processes on this node are `per_node`, by default the launcher's LOCAL_WORLD_SIZE (picotron.launch.place),
    else `world_size`; more of them than GPUs raises `device_problem`'s sentence instead of falling back to the CPU
    in silence. On the CPU path no CUDA function beyond is_available() is called (none at all for device="cpu")."""
    if per_node is None:
        per_node = launch.place().per_node(world_size)
    problem = device_problem(per_node, device)
    if problem:
        raise (RuntimeError if device in (None, "auto", "cuda") else ValueError)(problem)  # ValueError: no such device
    if device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def pipeline_links(p):
    """The pairs (a, b), a < b, of pipeline positions 0..p-1 that get a process group of their own: ring
    neighbours (r, r+1 mod p; the wrap carries the interleaved schedule's turn from the last stage to the first).

    Every message between two neighbours, both directions, is one batch on their group, in the one order the
    schedule gives every rank (pipeline_schedules.with_messages). A group of exactly the two ranks means every
    batch on it involves all its members, which torch asks of the first batched call on a group."""
    if p < 2:
        return []
    return sorted({tuple(sorted((r, (r + 1) % p))) for r in range(p)})


def _hsdp_dims(name, ranks, sizes):
    """The grid dimensions an HSDP axis spans: the shard axis is dp x cp when it is all of it (no HSDP), else
    ("dp_shard", "cp"), a part of dp (what picotron.marks reads to count a ZeRO piece once over the replicas)."""
    if name == "dp_shard":
        return ("dp", "cp") if len(ranks) == sizes["dp"] * sizes["cp"] else ("dp_shard", "cp")
    return ("dp",)  # the replicate axis: a part of dp


_WORLDS = itertools.count(1)  # numbers the worlds Mesh.init makes in this process (their store keys never meet)


class Axis:
    """One axis of the grid as this rank sees it: `name`, `dims` (the grid dimensions it spans: ("tp",), or
    ("dp", "cp") for the combined axis), `ranks` (the global ranks along it, ascending), `group`, `rank`
    (this rank's index along it), `size`. A strategy receives the axis it works on, never the whole mesh.

    Its collectives are the ones every strategy uses. They go through `comm.ops` (torch.distributed, or
    lesson 02's own picotron.collectives with `--collectives ours`) and, when one is attached, a
    `metrics.Recorder` that counts their bytes and times them; its point-to-point messages (`exchange`) are
    counted there too. Along an axis of size 1 they are free (no process group is touched), which is how a
    one-process `Mesh.local()` runs every strategy's code."""

    def __init__(self, name, ranks, group, rank, dims=None, comm=None):
        self.name, self.ranks, self.group, self.rank = name, list(ranks), group, rank
        self.size = len(self.ranks)
        self.dims = tuple(dims or (name,))
        self.comm = comm or Comm()

    @classmethod
    def alone(cls, name="tp", size=1, rank=0):
        """An axis without a process group: to BUILD rank `rank`'s shard of a size-`size` layout (no
        collective may run on it unless size is 1). What tests and lessons use to inspect layouts offline."""
        return cls(name, range(size), None, rank)

    def recorded(self, recorder):
        """The same axis with its collectives counted (and timed) by `recorder`."""
        return Axis(self.name, self.ranks, self.group, self.rank, self.dims, Comm(self.comm.ops, recorder))

    def over(self, link):
        """The same axis with its collectives held to an emulated link's time (picotron.link.EmulatedLink)."""
        return Axis(self.name, self.ranks, self.group, self.rank, self.dims,
                    Comm(link.ops(self.comm.ops), self.comm.recorder))

    def _run(self, kind, nbytes, call, async_op, label, info):
        recorder = self.comm.recorder
        if recorder is None:
            return call(async_op)
        start = recorder.now()
        work = call(async_op)
        return recorder.collective(kind, nbytes, work, label or kind.replace("_", "-"), start, axis=self.name, **info)

    def all_reduce(self, t, op=None, async_op=False, label=None, **info):
        """In place: t = the reduction (SUM by default) of every rank's t along this axis."""
        op = dist.ReduceOp.SUM if op is None else op
        if self.size == 1:
            return _DONE if async_op else None
        return self._run("all_reduce", t.numel() * t.element_size(),
                         lambda a: self.comm.ops.all_reduce(t, op=op, group=self.group, async_op=a), async_op, label, info)

    def all_gather_into(self, out, t, async_op=False, label=None, **info):
        """out (size x t's elements) = every rank's t, in rank order along this axis."""
        if self.size == 1:
            if out.data_ptr() != t.data_ptr():
                out.view(-1).copy_(t.reshape(-1))
            return _DONE if async_op else None
        gather = collective(self.comm.ops, "all_gather_into_tensor")  # this torch's spelling (picotron/compat.py)
        return self._run("all_gather", out.numel() * out.element_size(),
                         lambda a: gather(out, t, group=self.group, async_op=a),
                         async_op, label, info)

    def reduce_scatter_into(self, out, t, async_op=False, label=None, **info):
        """out = block `rank` (of size equal blocks of t) summed over the axis. `out` may be that block of t."""
        if self.size == 1:
            if out.data_ptr() != t.data_ptr():
                out.view(-1).copy_(t.reshape(-1))
            return _DONE if async_op else None
        scatter = collective(self.comm.ops, "reduce_scatter_tensor")  # this torch's spelling (picotron/compat.py)
        return self._run("reduce_scatter", t.numel() * t.element_size(),
                         lambda a: scatter(out, t, group=self.group, async_op=a),
                         async_op, label, info)

    def all_to_all_into(self, out, t, out_splits=None, in_splits=None, async_op=False, label=None, **info):
        """out = the blocks every rank sent this one, in rank order: t is cut along dim 0 into one block per rank
        (in_splits rows each, or equal blocks), out into the blocks received (out_splits rows each)."""
        if self.size == 1:
            if out.data_ptr() != t.data_ptr():
                out.copy_(t)
            return _DONE if async_op else None
        return self._run("all_to_all", t.numel() * t.element_size(),
                         lambda a: self.comm.ops.all_to_all_single(out, t, out_splits, in_splits, group=self.group,
                                                                   async_op=a), async_op, label, info)

    def exchange(self, ops, label="send"):
        """Point-to-point messages along this axis: `ops` = [("send" | "recv", tensor, global peer rank), ...], posted
        as one batch (picotron.p2p.exchange); returns the handles to wait on. A recorder counts the bytes of the
        sends, under `label` (what they carry); it does not time them: a message is over when its receiver has
        waited for it, which the algorithm shows as a phase of its own (picotron.hooks)."""
        # an emulated link (picotron.link, made with messages=True) holds the batch to its time; others post it as is
        post = getattr(self.comm.ops, "exchange_batch", None) or p2p.exchange
        recorder = self.comm.recorder
        start = recorder.now() if recorder is not None else 0.0
        works = post(ops, self.group)
        if recorder is not None:
            sent = sum(t.numel() * t.element_size() for kind, t, _ in ops if kind == "send")
            recorder.message(sent, label, axis=self.name)
            if getattr(recorder, "time_messages", False):  # async TP's lesson: the batch as a timeline event
                works = recorder.timed_messages(works, label, start, axis=self.name)
        return works

    def broadcast(self, t, index=0):
        """In place: every rank's t = the t of the rank at `index` along this axis."""
        if self.size > 1:
            self._run("broadcast", t.numel() * t.element_size(),
                      lambda a: self.comm.ops.broadcast(t, src=self.ranks[index], group=self.group, async_op=a),
                      False, None, {})

    def mean(self, t):
        """The mean of t over the axis (a new tensor; t itself when the axis has one rank)."""
        if self.size == 1:
            return t
        t = t.clone()
        self.all_reduce(t)
        return t / self.size

    def __repr__(self):
        return f"Axis({self.name}: rank {self.rank} of {self.size}, ranks {self.ranks})"


class _Done:
    """The handle of a collective that has nothing left to do."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


_DONE = _Done()


class Comm:
    """Which collectives the axes run (`ops`: a module with torch.distributed's signatures) and who counts them."""

    def __init__(self, ops=None, recorder=None):
        self.ops, self.recorder = ops or dist, recorder


def collective_ops(name):
    """'torch': torch.distributed's own (NCCL, gloo); 'ours': lesson 02's picotron.collectives, from send/recv."""
    if name == "torch":
        return dist
    if name == "ours":
        from picotron import collectives as ours
        return ours
    raise ValueError(f"collectives={name!r}; use 'torch' or 'ours'.")


class Mesh:
    """This process's place on the (dp, pp, cp, tp) grid: one declared `Axis` per dimension.

    Attributes: rank, world_size, local_rank, per_node (the processes on this machine: torchrun's
    LOCAL_WORLD_SIZE, else all), device, backend, sizes, coords, and the axes
    `dp`, `pp`, `cp`, `tp`, `dp_cp` (dp x cp together: gradients of replicated parameters are averaged over
    it), `ep` and `edp` (the experts' axes carved from dp: see the module docstring), `dp_shard` and
    `dp_replicate` (HSDP's shard and replicate groups, `shard_groups`; without HSDP dp x cp and one rank), `pp_ends` (the first and last pipeline stage, which share tied embeddings) and `world`, each with .group / .rank / .size / .ranks and the collectives; pp_prev_rank /
    pp_next_rank (global ranks, None at the ends); is_first_stage / is_last_stage; `pp_links`: {(lower, higher):
    Axis} for this rank's pipeline neighbours, one two-rank axis (a group) per pair (`pipeline_links`), whose
    messages (`Axis.exchange`) are counted by this mesh's recorder like its collectives.
    """

    AXES = ("dp", "pp", "cp", "tp", "dp_cp", "ep", "edp", "dp_shard", "dp_replicate", "pp_ends", "world")

    def __init__(self, rank, world_size, sizes, device, backend, groups, local_rank=0, owns_world=False,
                 collectives="torch", links=None, per_node=None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.per_node = per_node or world_size
        self.device, self.backend = device, backend
        self.sizes = _as_sizes(sizes)
        self.coords = grid_coords(rank, self.sizes)
        self.comm = Comm(collective_ops(collectives))  # shared by every axis of this mesh
        self._created, self._owns_world = [], owns_world
        for name, (ranks, group, created) in groups.items():
            dims = ORDER if name == "world" else ("dp", "cp") if name in ("dp_cp", "edp") else ("pp",) \
                if name == "pp_ends" else _hsdp_dims(name, ranks, self.sizes) if name.startswith("dp_") else (name,)
            setattr(self, name, Axis(name, ranks, group, ranks.index(rank), dims, self.comm))
            if created:
                self._created.append(group)
        self._links = dict(links or {})  # (lower, higher) global ranks of two neighbours -> their group
        self._created += list(self._links.values())
        self.pp_links = self._link_axes(self.comm)
        self.is_first_stage = self.pp.rank == 0
        self.is_last_stage = self.pp.rank == self.pp.size - 1
        self.pp_prev_rank = None if self.is_first_stage else self.rank_of(pp=self.pp.rank - 1)
        self.pp_next_rank = None if self.is_last_stage else self.rank_of(pp=self.pp.rank + 1)

    @classmethod
    def local(cls, device="cpu"):
        """A one-process mesh that needs no process group (every axis has size 1): one device, and the same
        code path as a parallel run. What single-device lessons and tests build models with."""
        groups = {name: ([0], None, False) for name in cls.AXES}
        return cls(0, 1, (1, 1, 1, 1), torch.device(device), None, groups)

    @classmethod
    def init(cls, dp=1, pp=1, cp=1, tp=1, ep=1, timeout_s=300, backend=None, device=None, collectives="torch",
             place=None, dp_shard=0):
        """Join (or create) the default process group and build the per-axis groups.

        - a process group already exists (e.g. inside `launch.run_on_ranks`): use it as the world;
        - RANK/WORLD_SIZE are set (torchrun; `place`, by default picotron.launch.place()): initialise from
          MASTER_ADDR/MASTER_PORT (env://);
        - neither, and the grid has one cell: a one-process group on an in-memory HashStore, so
          `python -m picotron.train` needs no launcher.
        Every rank must call this with the same sizes: new_group is collective and called in the same order.
        `collectives`: "torch" (torch.distributed's) or "ours" (picotron.collectives, built from send/recv).
        `dp_shard`: HSDP's shard size (0: dp, one block; see `shard_groups`).
        """
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        need = math.prod(sizes.values())
        timeout = timedelta(seconds=timeout_s)
        owns_world = not dist.is_initialized()
        place = place or launch.place()
        if not owns_world:
            rank, world_size = dist.get_rank(), dist.get_world_size()
            local_rank = rank if place.local_rank is None else place.local_rank
            backend = dist.get_backend()
            dev, _ = pick_device(world_size, local_rank, device or ("cpu" if backend == "gloo" else None),
                                 place.per_node(world_size))
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
        else:
            in_env = place.launched and place.rank is not None
            rank, world_size = (place.rank, place.world_size) if in_env else (0, 1)
            local_rank = rank if place.local_rank is None else place.local_rank
            if world_size != need:
                raise RuntimeError(f"the grid dp*pp*cp*tp={need} needs {need} processes but WORLD_SIZE={world_size}; "
                                   f"launch with torchrun --nproc_per_node {need}.")
            dev, default_backend = pick_device(world_size, local_rank, device, place.per_node(world_size))
            backend = backend or default_backend
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            if in_env:  # torchrun: its store, our keys prefixed by the attempt (a restarted job must not read
                # the addresses the previous attempt's ranks published: seen on gloo after --max-restarts)
                store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
                prefix = f"picotron/attempt_{place.attempt}/world_{next(_WORLDS)}"  # (every rank counts alike)
                dist.init_process_group(backend, store=dist.PrefixStore(prefix, store),
                                        rank=rank, world_size=world_size, timeout=timeout,
                                        device_id=dev if dev.type == "cuda" else None)
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        if world_size != need:
            raise RuntimeError(f"the grid dp*pp*cp*tp={need} does not match the {world_size} running processes.")

        groups = {}  # every rank walks the same groups in the same order: new_group is collective
        for name, dims in [("dp", "dp"), ("pp", "pp"), ("cp", "cp"), ("tp", "tp"), ("dp_cp", ("dp", "cp"))]:
            for ranks in group_ranks(sizes, dims):
                if len(ranks) == world_size:
                    group, created = dist.group.WORLD, False
                else:
                    group, created = dist.new_group(ranks, timeout=timeout), True
                if rank in ranks:
                    groups[name] = (ranks, group, created)
        for ranks in group_ranks(sizes, "pp"):  # the first and last stage: tied embeddings sync between them
            ends = sorted({ranks[0], ranks[-1]})
            group, created = (dist.new_group(ends, timeout=timeout), True) if len(ends) > 1 else (None, False)
            if rank in ranks:
                groups["pp_ends"] = (ends, group, created) if rank in ends else ([rank], None, False)
        links = {}  # one group per pair of pipeline neighbours (pipeline_links)
        for ranks in group_ranks(sizes, "pp"):
            for a, b in pipeline_links(len(ranks)):
                group = dist.new_group([ranks[a], ranks[b]], timeout=timeout)
                if rank in (ranks[a], ranks[b]):
                    links[tuple(sorted((ranks[a], ranks[b])))] = group
        def carve(names, lists, is_dp_cp):  # axes carved from dp: reuse the world or dp x cp's group where they are it
            for name, group_lists in zip(names, lists):
                for ranks in group_lists:
                    if len(ranks) == world_size:
                        group, created = dist.group.WORLD, False
                    elif is_dp_cp(name, ranks):
                        group, created = (groups["dp_cp"][1] if rank in ranks else None), False
                    elif len(ranks) == 1:  # (every group has this size: every rank takes this branch)
                        group, created = None, False
                    else:
                        group, created = dist.new_group(ranks, timeout=timeout), True
                    if rank in ranks:
                        groups[name] = (ranks, group, created)

        # the experts' axes (at ep = 1 their replicas, edp, are all of dp x cp) and HSDP's (without HSDP the shard
        # group is dp x cp itself)
        carve(("ep", "edp"), expert_groups(sizes, ep), lambda name, ranks: name == "edp" and ep == 1)
        carve(("dp_shard", "dp_replicate"), shard_groups(sizes, dp_shard),
              lambda name, ranks: name == "dp_shard" and len(ranks) == dp * cp)
        groups["world"] = (list(range(world_size)), dist.group.WORLD, False)
        return cls(rank, world_size, sizes, dev, backend, groups, local_rank, owns_world, collectives, links,
                   place.per_node(world_size))

    def recorded(self, recorder):
        """The same mesh (same groups, same ranks) with every axis's collectives counted and timed by `recorder`
        (a metrics.Recorder): what a lesson builds a run on to see all of its traffic. Never destroy the copy."""
        return self._with(Comm(self.comm.ops, recorder))

    def over(self, link):
        """The same mesh with every axis's collectives held to an emulated link's time (picotron.link): what a
        lesson runs on to see communication overlap on a CPU. Compose with `recorded` in either order."""
        return self._with(Comm(link.ops(self.comm.ops), self.comm.recorder))

    def _with(self, comm):
        """A copy of this mesh (same groups) whose axes run their collectives through `comm`."""
        mesh = copy.copy(self)
        mesh.comm = comm
        for name in self.AXES:
            a = getattr(self, name)
            setattr(mesh, name, Axis(a.name, a.ranks, a.group, a.rank, a.dims, comm))
        mesh.pp_links = mesh._link_axes(comm)
        return mesh

    def _link_axes(self, comm):
        """{(lower, higher): the "pp" axis of the two ranks, on their group}."""
        return {pair: Axis("pp", sorted(pair), group, sorted(pair).index(self.rank), ("pp",), comm)
                for pair, group in self._links.items()}

    def rank_of(self, **coords):
        """Global rank of the cell that matches this rank except for the given coordinates, e.g. rank_of(tp=0)."""
        return grid_rank({**self.coords, **coords}, self.sizes)

    def agree(self, flag):
        """True on every rank if `flag` is true on any (one tiny all-reduce; none at world size 1).

        For decisions every rank must take together, such as stopping after this step on Ctrl-C."""
        if self.world_size == 1:
            return bool(flag)
        t = torch.tensor([float(bool(flag))], device=self.device)
        self.world.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def destroy(self, wait=False):
        """Destroy the groups this mesh made (and the world group if Mesh.init created it).

        Objects still referenced only from cycles (autograd graphs, module hooks) are collected first, so no
        collective's pending work outlives its group into interpreter shutdown (gloo aborts the process then).
        `wait=True` (a normal end, every rank here): a barrier first, so no rank tears its groups down while
        another still has a collective in flight, and the backend's threads have let go of the last collective's
        tensors before the interpreter shuts down (on torch 2.5 a gloo thread freeing one then aborts the process:
        "terminate called without an active exception"). `with mesh:` does this on success, not after an error."""
        if not dist.is_initialized():
            return
        gc.collect()
        if wait:
            dist.barrier()
        for group in self._created:
            dist.destroy_process_group(group)
        self._created = []
        if self._owns_world:
            dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.destroy(wait=exc_type is None)

    def __repr__(self):
        grid = " ".join(f"{d}={self.sizes[d]}" for d in ORDER)
        where = " ".join(f"{d}={self.coords[d]}" for d in ORDER)
        return f"Mesh(rank {self.rank}/{self.world_size}, grid {grid}, coords {where}, {self.device}/{self.backend})"
