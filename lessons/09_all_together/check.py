"""Checker for lesson 09's exercises.

    ./run.sh python lessons/09_all_together/check.py [name ...] [--solutions | --module my.py]
(what each option does, and the call from the notebook: lessons/_checker.py.) Everything runs in this process
(no process group: the exercises are arithmetic on layouts).

place: every rank of several 4-D grids against picotron.mesh (`grid_coords`, `group_ranks`); names the rank, the
axis and the group, and recognises dp numbered fastest (tp slowest), a group along the wrong axis, and a group
missing this rank.
step_batch: the global-batch arithmetic of several layouts; names the field, and recognises the sequences divided
over dp x cp or over every rank (cp cuts sequences, tp and pp cut the model: neither reads more of them), the
micro-batch size forgotten, the tokens per micro-batch not divided by cp, the bubble of the wrong formula, and an
impossible batch accepted.
clock_shifts: the merged trace's clocks (picotron.trace.merge); recognises every rank shifted by its own marker,
one shift for every machine, and the machine's last barrier leaver taken for its first.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
from _checker import entry_points, in_process  # noqa: E402

from picotron.mesh import ORDER, grid_coords, group_ranks  # noqa: E402


LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
TIMEOUT_S = 30.0
EXERCISES = {"place": "place", "step_batch": "step_batch", "memory_by_part": "memory_by_part", "choose": "choose",
             "clock_shifts": "clock_shifts"}

GRIDS = (dict(dp=2, pp=2, cp=2, tp=2), dict(dp=2, pp=1, cp=1, tp=4), dict(dp=3, pp=2, cp=2, tp=4),
         dict(dp=1, pp=4, cp=1, tp=2), dict(dp=4, pp=1, cp=2, tp=1))


def _name(sizes):
    return "·".join(f"{d}{sizes[d]}" for d in ORDER)


def _reversed_coords(rank, sizes):
    """The coordinates if dp varied fastest (tp slowest)."""
    c = {}
    for d in ORDER:
        rank, c[d] = divmod(rank, sizes[d])
    return c


# ------------------------------------------------------------------------------------------ exercise 1
def _place_problem(fn, path):
    for sizes in GRIDS:
        n = sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
        head = _name(sizes)
        groups_of = {a: group_ranks(sizes, a) for a in ORDER}
        for rank in range(n):
            got = fn(rank, dict(sizes))
            if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, dict) for x in got)):
                return f"{head}, rank {rank}: returned {str(got)[:60]!r}; return the pair (coords, groups), two dicts"
            coords, groups = got
            want = grid_coords(rank, sizes)
            if {d: coords.get(d) for d in ORDER} != want:
                if {d: coords.get(d) for d in ORDER} == _reversed_coords(rank, sizes):
                    return (f"{head}, rank {rank}: coordinates {coords}, expected {want}: you numbered dp fastest; in "
                            f"picotron tp varies fastest (rank = ((dp·pp_size + pp)·cp_size + cp)·tp_size + tp), so a "
                            f"tp group is consecutive ranks, on one node")
                return f"{head}, rank {rank}: coordinates {coords}, expected {want}"
            for axis in ORDER:
                mine = groups.get(axis)
                right = next(g for g in groups_of[axis] if rank in g)
                if mine is None:
                    return f"{head}, rank {rank}: no group for axis {axis!r}; return one list of ranks per axis"
                mine = list(mine)
                if sorted(mine) == right:
                    if mine != right:
                        return (f"{head}, rank {rank}: {axis} group {mine}, expected {right}: the right ranks, but in "
                                f"the order of their {axis} coordinate (index i of the list holds {axis} = i)")
                    continue
                if rank not in mine:
                    return f"{head}, rank {rank}: its {axis} group {mine} does not contain rank {rank}; expected {right}"
                other = [a for a in ORDER if a != axis and sorted(mine) == next(g for g in groups_of[a] if rank in g)]
                if other:
                    return (f"{head}, rank {rank}: {axis} group {mine}, expected {right}: that is its {other[0]} group "
                            f"(the ranks that differ only in {other[0]})")
                return (f"{head}, rank {rank}: {axis} group {mine}, expected {right} (the ranks that agree with it on "
                        f"every coordinate but {axis})")
    return None


# ------------------------------------------------------------------------------------------ exercise 4
# (global batch in tokens, seq_len, micro-batch, layout); the first is Llama 3 405B's 16,384 GPUs (tp8, pp16, dp128)
BATCHES = ((4 * 2**20, 4096, 1, dict(dp=128, pp=16, cp=1, tp=8)),
           (2**20, 2048, 4, dict(dp=8, pp=1, cp=1, tp=1)),
           (2**21, 8192, 2, dict(dp=4, pp=2, cp=2, tp=4)),
           (2**19, 1024, 2, dict(dp=16, pp=4, cp=1, tp=2)),
           (2**22, 32768, 1, dict(dp=2, pp=4, cp=8, tp=8)))
IMPOSSIBLE = ((2**20, 4096, 4, dict(dp=48, pp=1, cp=1, tp=8)), (1000, 128, 1, dict(dp=1, pp=1, cp=1, tp=1)))


def _world(case):
    sizes = case[-1]
    return sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]


def _want_batch(tokens, s, b, sizes):
    seqs = tokens // s
    m = seqs // (sizes["dp"] * b)
    return dict(sequences=seqs, grad_acc=m, tokens_per_micro_batch=b * s // sizes["cp"],
                bubble=(sizes["pp"] - 1) / (m + sizes["pp"] - 1))


def _batch_problem(fn, path):
    for tokens, s, b, sizes in BATCHES:
        head = f"{tokens:,} tokens per step, sequences of {s}, micro-batch {b}, {_name(sizes)}"
        want = _want_batch(tokens, s, b, sizes)
        try:
            got = fn(tokens, s, b, dict(sizes))
        except ValueError as e:
            return (f"{head}: raised ValueError({str(e)[:80]!r}), but this batch is reachable: {want['sequences']} "
                    f"sequences = dp {sizes['dp']} x micro-batch {b} x {want['grad_acc']} micro-steps (only the dp "
                    f"replicas read different sequences)")
        if not isinstance(got, dict):
            return f"{head}: returned {str(got)[:60]!r}; return a dict with {', '.join(want)}"
        for key in want:
            if key not in got:
                return f"{head}: no {key!r} in your dict; return {', '.join(want)}"
        if got["sequences"] != want["sequences"]:
            return f"{head}: sequences = {got['sequences']}, expected {want['sequences']} (tokens / seq_len)"
        m, world = got["grad_acc"], sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]
        if m != want["grad_acc"]:
            seqs = want["sequences"]
            hints = {seqs // (sizes["dp"] * sizes["cp"] * b): "you divided by dp x cp: cp ranks share each sequence "
                                                             "(each holds seq_len / cp of its tokens), they do not "
                                                             "read more sequences",
                     seqs // (world * b): "you divided by every rank: only the dp replicas read different sequences; "
                                          "tp and pp ranks of one replica work on the same micro-batch",
                     seqs // sizes["dp"]: "you forgot the micro-batch size: each replica's micro-step reads "
                                          f"{b} sequences"}
            hint = hints.get(m, "grad_acc = sequences / (dp x micro_batch_size)")
            return f"{head}: grad_acc = {m}, expected {want['grad_acc']}: {hint}"
        if got["tokens_per_micro_batch"] != want["tokens_per_micro_batch"]:
            hint = (": cp cuts every sequence, so each rank holds seq_len / cp tokens of each"
                    if got["tokens_per_micro_batch"] == b * s else "")
            return (f"{head}: tokens_per_micro_batch = {got['tokens_per_micro_batch']}, expected "
                    f"{want['tokens_per_micro_batch']} (what one rank's activations are made of){hint}")
        if abs(got["bubble"] - want["bubble"]) > 1e-9:
            p = sizes["pp"]
            hint = ""
            if abs(got["bubble"] - (p - 1) / m) < 1e-9:
                hint = (": (pp-1)/m is the bubble relative to the useful time; the fraction of the step is "
                        "(pp-1)/(m+pp-1)")
            return f"{head}: bubble = {got['bubble']:.4f}, expected {want['bubble']:.4f} (1F1B, m = grad_acc){hint}"
    for tokens, s, b, sizes in IMPOSSIBLE:
        head = f"{tokens:,} tokens per step, sequences of {s}, micro-batch {b}, {_name(sizes)}"
        try:
            got = fn(tokens, s, b, dict(sizes))
        except ValueError:
            continue
        return (f"{head}: returned {got}; no whole number of micro-steps gives this batch "
                f"({tokens / s:g} sequences over dp x micro-batch = {sizes['dp'] * b}): raise ValueError")
    return None


# ------------------------------------------------------------------------------------------ exercise 3
GiB = 2**30
# (model, sequence, layout); every stage of each is checked. 1F1B with m < pp in the last one.
MEMORY_CASES = (("llama3-8b", 8192, "dp8,tp2,pp4,zero1,mbs1,ga16"), ("llama3-8b", 8192, "dp4,cp2,zero3,mbs1,ga8"),
                ("smollm-1.7b", 2048, "dp16,cp2,pp2,zero1,mbs2,ga8"), ("llama3-8b", 4096, "dp2,tp4,cp2,zero2,mbs1,ga4"),
                ("smollm-1.7b", 2048, "dp4,pp8,zero1,mbs1,ga3"))


def _memory_case(name, seq, text):
    """(layout, [(params, one micro-batch's activations, the planner's row) per stage]) from picotron.planner."""
    from dataclasses import replace

    from picotron import planner
    from picotron.model import ModelConfig

    mc, layout = ModelConfig.from_preset(name), planner.Layout.parse(text)
    rows = planner.memory_per_stage(mc, layout, seq, "bf16", "mixed")
    bare = planner.memory_per_stage(mc, replace(layout, zero=0, grad_acc=1), seq, "bf16", "mixed")
    return layout, [(b["params"] // 2, b["activations"], r) for b, r in zip(bare, rows)]


def _memory_problem(fn, path):
    for name, seq, text in MEMORY_CASES:
        layout, stages = _memory_case(name, seq, text)
        shard, z, m = layout.dp * layout.cp, layout.zero, layout.grad_acc
        for stage, (params, act, want) in enumerate(stages):
            head = f"{name}, s={seq}, {text}, stage {stage} ({params:,} parameters, {act / GiB:.2f} GiB per micro-batch)"
            got = fn(params, layout, act, stage)
            if not isinstance(got, dict) or any(k not in got for k in MEM_KEYS):
                return f"{head}: returned {str(got)[:60]!r}; return a dict with {', '.join(MEM_KEYS)}"
            for key in MEM_KEYS:
                g, w = float(got[key]), want[key]
                if abs(g - w) <= max(2.0, 1e-9 * w):
                    continue
                hint = ""
                if key == "optimizer" and abs(g - w * 8 / 12) <= 2:
                    hint = ": 8 bytes per parameter are AdamW's moments; mixed precision also keeps an fp32 master copy (4)"
                elif z and abs(g * layout.dp - w * shard) <= 2 * shard and layout.cp > 1:
                    hint = (f": you sharded over dp = {layout.dp}; ZeRO shards over dp x cp = {shard} (the cp ranks "
                            f"hold the same parameters and average their gradients too)")
                elif key in ("grads", "params") and abs(g * shard - w) <= 2 * shard:
                    hint = f": ZeRO-{z} does not shard the {key} (ZeRO-1: optimizer state; 2: + gradients; 3: + parameters)"
                elif key in ("grads", "params", "optimizer") and abs(g - w * shard) <= 2 * shard:
                    hint = f": ZeRO-{z} shards the {key} over the dp x cp = {shard} ranks"
                elif key == "activations":
                    alive = min(layout.pp - stage, m)
                    mistakes = {act * m: f"{m} micro-batches alive is AFAB's peak; 1F1B keeps pp - stage",
                                act * layout.pp: "1F1B keeps pp - stage micro-batches alive on a stage, not pp",
                                act * (layout.pp - stage): f"only m = {m} micro-batches exist: at most m are alive",
                                act: "one micro-batch: 1F1B starts pp - stage forwards before the first backward"}
                    hint = next((f": {why}" for v, why in mistakes.items() if v != act * alive and abs(g - v) <= 2), "")
                    hint += f" (alive: min(pp - stage, m) = {alive})" if not hint else ""
                return f"{head}: {key} = {g / GiB:.3f} GiB, expected {w / GiB:.3f} GiB{hint}"
    return None


MEM_KEYS = ("params", "grads", "optimizer", "activations")


# ------------------------------------------------------------------------------------------ exercise 4
# Llama 3 8B on 16 GPUs, sequences of 8192, 256 per step (2M tokens), with the memory a layout may use (section 5's
# 10% headroom kept free) of an H100 80GB, 71.7 GiB of its 79.6, then of an A100 40GB, 35.6 GiB of its 39.6.
CHOICES = ("dp16,mbs1,ga16", "dp16,zero3,mbs1,ga8", "dp8,tp2,mbs1,ga8", "dp8,tp2,sp,zero1,mbs1,ga32",
           "dp16,zero2,mbs2,ga8", "dp4,pp4,zero1,mbs1,ga64", "tp8,pp2,mbs1,ga256", "dp16,zero1,mbs1,ga16",
           "dp16,zero3,recompute-full,mbs2,ga4", "dp8,cp2,zero3,mbs1,ga32")
CHOICE_JOB = dict(model="llama3-8b", seq=8192, global_seqs=256, budgets=("h100-80gb", "a100-40gb"))


def _choice_tools():
    from picotron import plan, planner
    from picotron.model import ModelConfig

    mc, seq, hw = ModelConfig.from_preset(CHOICE_JOB["model"]), CHOICE_JOB["seq"], plan.GPUS["h100-80gb"]
    layouts = [planner.Layout.parse(t) for t in CHOICES]
    mem = {x: planner.memory_per_gpu(mc, x, seq, "bf16", "mixed")["total"] / GiB for x in layouts}
    sec = {x: plan.step_time(mc, x, seq, hw)["total"] for x in layouts}
    return layouts, mem, sec


def reference_choice(layouts, mem, sec, budget, seqs):
    rejected, kept = [], []
    for x in layouts:
        if mem[x] > budget:
            rejected.append((x, "memory"))
        elif x.dp * x.micro_batch_size * x.grad_acc != seqs:
            rejected.append((x, "batch"))
        else:
            kept.append(x)
    return (min(kept, key=sec.get) if kept else None), rejected


def _choose_problem(fn, path):
    from picotron import plan

    layouts, mem, sec = _choice_tools()
    seqs = CHOICE_JOB["global_seqs"]
    for budget in CHOICE_JOB["budgets"]:
        budget = plan.usable(plan.GPUS[budget]).memory / GiB if isinstance(budget, str) else budget
        head = f"{CHOICE_JOB['model']} on 16 GPUs of {budget:.1f} GiB, {seqs} sequences of {CHOICE_JOB['seq']} per step"
        want_best, want_rej = reference_choice(layouts, mem, sec, budget, seqs)
        got = fn(list(layouts), lambda x: mem[x], lambda x: sec[x], budget, seqs)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return f"{head}: returned {str(got)[:60]!r}; return (best, rejected)"
        best, rejected = got
        reasons = {}
        for item in rejected or ():
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                return f"{head}: rejected holds {str(item)[:60]!r}; each item is (layout, 'memory' or 'batch')"
            reasons[item[0]] = item[1]
        want = dict(want_rej)
        for x in layouts:
            n = x.dp * x.micro_batch_size * x.grad_acc
            what = f"{x} ({mem[x]:.1f} GiB, {n} sequences per step)"
            if x in want and x not in reasons:
                return (f"{head}: you kept {what}: " + (f"it needs {mem[x]:.1f} GiB > {budget:.1f}" if want[x] == "memory"
                        else f"it runs {n} sequences per step, not {seqs}"))
            if x not in want and x in reasons:
                return (f"{head}: you rejected {what} for {reasons[x]!r}, but it fits ({mem[x]:.1f} <= {budget:.1f} GiB) "
                        f"and runs {seqs}")
            if x in want and reasons[x] != want[x]:
                both = " (it fails both: the memory, step 1, is checked first)" if mem[x] > budget else ""
                return f"{head}: you rejected {what} for {reasons[x]!r}, expected {want[x]!r}{both}"
        if [x for x, _ in rejected] != [x for x, _ in want_rej]:
            return f"{head}: rejected in another order than the candidates'; list them as you try them"
        if best != want_best:
            if best is None:
                return f"{head}: no best layout returned; {want_best} fits and reaches the batch"
            if best in want and want[best] == "batch":
                return (f"{head}: you picked {best} ({sec[best]:.2f} s per step), but it runs "
                        f"{best.dp * best.micro_batch_size * best.grad_acc} sequences per step, not {seqs}: its step is "
                        f"short because it does less work")
            kept = [x for x in layouts if x not in want]
            if best == min(kept, key=mem.get):
                return (f"{head}: you picked {best}, the one needing the least memory ({mem[best]:.1f} GiB); step 3 "
                        f"maximises throughput: {want_best} takes {sec[want_best]:.2f} s per step against {sec[best]:.2f}")
            return f"{head}: best {best} ({sec[best]:.2f} s per step), expected {want_best} ({sec[want_best]:.2f} s)"
    return None


# ---------------------------------------------------------------------------- clock_shifts (section 2b)
# (markers µs, hosts): one machine whose ranks left the barrier 0.3-7 ms apart (gloo on busy cores); two machines
# whose clocks disagree by 5 s; two machines of four ranks, their lists in no particular order
CLOCKS = (({0: 1000.0, 1: 1300.0, 2: 8000.0, 3: 1100.0}, {0: "a", 1: "a", 2: "a", 3: "a"}),
          ({0: 1000.0, 1: 1250.0, 2: 5_002_000.0, 3: 5_001_900.0}, {0: "a", 1: "a", 2: "b", 3: "b"}),
          ({3: 7e12 + 40.0, 0: 7e12 + 900.0, 1: 7e12 + 10.0, 2: 3e12 + 5.0, 4: 3e12 + 77.0, 5: 7e12 + 3.0,
            6: 3e12 + 1.0, 7: 3e12},
           {3: "n0", 0: "n0", 1: "n0", 5: "n0", 2: "n1", 4: "n1", 6: "n1", 7: "n1"}))


def _clock_problem(fn, path):
    for markers, hosts in CLOCKS:
        want = {r: min(markers[q] for q in markers if hosts[q] == hosts[r]) for r in markers}
        got = fn(dict(markers), dict(hosts))
        if not isinstance(got, dict) or set(got) != set(markers):
            return f"return {{rank: shift}} for the ranks {sorted(markers)}, got {str(got)[:60]!r}"
        bad = [r for r in sorted(markers) if abs(got[r] - want[r]) > 1e-6]
        if not bad:
            continue
        r, machines = bad[0], len(set(hosts.values()))
        head = f"{len(markers)} ranks on {machines} machine(s), rank {r}: shift {got[r]:.1f} µs, expected {want[r]:.1f}"
        if all(abs(got[q] - markers[q]) < 1e-6 for q in markers):
            return (f"{head}: you shifted every rank by its own marker, which adds its lag in leaving the barrier "
                    f"({markers[r] - want[r]:.0f} µs) to all its times; the ranks of one machine share its clock: "
                    f"shift them together")
        if all(abs(got[q] - markers[0]) < 1e-6 for q in markers) or all(abs(got[q] - min(markers.values())) < 1e-6
                                                                        for q in markers):
            return (f"{head}: one shift for every rank keeps the machines' clocks apart ({machines} machines, whose "
                    f"clocks disagree); each machine needs its own")
        if abs(got[r] - max(markers[q] for q in markers if hosts[q] == hosts[r])) < 1e-6:
            return (f"{head}: that is the machine's LAST rank to leave the barrier; the first is the closest to the "
                    f"instant it released everyone")
        return head
    return None


def _in_process(name, path, report, problem_of, success):
    return in_process(name, path, report, problem_of, success, "ex09")


SUCCESS = {
    "place": f": coordinates and the four groups of every rank of {', '.join(_name(g) for g in GRIDS)}",
    "step_batch": f": {len(BATCHES)} layouts from {min(map(_world, BATCHES)):,} to {max(map(_world, BATCHES)):,} GPUs, "
                  f"and {len(IMPOSSIBLE)} impossible batches refused",
    "memory_by_part": f": every stage of {len(MEMORY_CASES)} layouts of SmolLM-1.7B and Llama 3 8B equals "
                      f"picotron.planner.memory_per_stage (bf16, mixed)",
    "choose": f": {len(CHOICES)} layouts of {CHOICE_JOB['model']} on 16 GPUs, with 71.7 GiB per GPU (an H100's 90%) "
              f"and with 35.6 GiB (an A100 40GB's 90%)",
}
PROBLEMS = {"place": _place_problem, "step_batch": _batch_problem, "memory_by_part": _memory_problem,
            "choose": _choose_problem, "clock_shifts": _clock_problem}
SUCCESS["clock_shifts"] = f": {len(CLOCKS)} jobs of 4 to 8 ranks on 1 or 2 machines, one clock per machine"


def check_one(name, path, report, timeout_s):
    return _in_process(name, path, report, PROBLEMS[name], SUCCESS[name])


check, main = entry_points("Check lesson 09's exercises (in this process).", EXERCISES, check_one, LEARNER,
                           SOLUTIONS, TIMEOUT_S, "ex09")


if __name__ == "__main__":
    sys.exit(main())
