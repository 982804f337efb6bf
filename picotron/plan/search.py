"""The layout search: every layout of a job (`candidates`), each checked (`check_layout`: picotron.rules' sentence,
the job's batch, the nodes, the memory of picotron.planner) and ranked by step_time's tokens/s (`search`); when none
fits, the least memory any layout needs (`least_memory`), the fewest GPUs at which one fits (`fewest_gpus`) and the
refusals that keep out a layout needing less (`bounding`).

Runs or not: a layout picotron's trainer refuses is refused with the trainer's sentence (`trainer_problem`:
picotron.rules.layout_problem, each strategy's rule and `combination_problem`; no copy here). Runs of other software
(rules=False) meet only what the strategies' shapes need (rules.SHAPE_RULES).
"""
import math
from dataclasses import dataclass, field, replace

from picotron.rules import layout_problem
from picotron.config import Config
from picotron.plan.hardware import GiB
from picotron.plan.time_model import shard_span, step_time
from picotron.planner import RECIPES, Layout, memory_per_gpu

def _divisors(n, limit=None):
    return [k for k in range(1, n + 1) if n % k == 0 and (limit is None or k <= limit)]


def trainer_problem(mc, layout, seq_len, dtype="bf16"):
    """The sentence with which picotron's trainer refuses this layout, or None: the rules its `validate` applies
    before any process group exists (picotron.rules.layout_problem: each strategy's rule, then
    `combination_problem`), so the planner keeps no copy of them; and Llama 3's bare-ends cut, which no training
    setting of picotron's names (its pipeline puts a layer in every chunk)."""
    return BARE_ENDS if layout.bare_ends else layout_problem(_config(layout, seq_len, dtype), mc)


BARE_ENDS = ("bare-ends (the first chunk only the embedding, the last only the head: Llama 3's cut) is not picotron's: "
             "its pipeline puts at least one layer in every chunk; drop bare-ends.")


def _config(layout, seq_len, dtype):
    """The training settings of a layout (the rest as picotron.config's defaults)."""
    return Config(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, sp=layout.sp, zero=layout.zero,
                  pp_schedule=layout.pp_schedule, pp_chunks=layout.pp_chunks, cp_impl=layout.cp_impl,
                  micro_batch_size=layout.micro_batch_size, grad_acc=max(1, layout.grad_acc),
                  recompute=layout.recompute, seq_len=seq_len, dtype="fp32" if dtype == "fp32" else "bf16-params",
                  async_tp=layout.async_tp, dp_shard=layout.dp_shard)


def check_layout(mc, layout, seq_len, hw, global_seqs, dtype="bf16", recipe="mixed", cross_node_tp=False,
                 rules=True):
    """(memory row, None) if the layout can run this job, else (memory row or None, one sentence why not). What this
    adds to picotron.rules is the job's: the global batch, the nodes a tp group spans (wider than a node is refused
    unless `cross_node_tp`: then it runs, its all-reduces on the network) and the memory. `rules`: refuse what
    picotron's trainer refuses (`trainer_problem`); off for runs of other software (PUBLISHED), judged only by each
    strategy's shape rules (what any trainer of them needs: rules.SHAPE_RULES) and their memory."""
    if global_seqs % (layout.dp * layout.micro_batch_size):
        return None, _indivisible(global_seqs, layout)
    cfg = _config(layout, seq_len, dtype)
    shape = replace(mc, num_hidden_layers=mc.num_hidden_layers + 2) if layout.bare_ends else mc  # (its bare chunks
    # take the place of a layer each in the rule that every chunk has one)
    problem = layout_problem(cfg, shape, trainer=rules) or (BARE_ENDS if rules and layout.bare_ends else None)
    if problem:
        return None, problem
    if layout.bare_ends and not 3 <= layout.pp * layout.pp_chunks <= mc.num_hidden_layers + 2:
        return None, (f"bare-ends needs between 3 and {mc.num_hidden_layers + 2} pipeline chunks in all (the embedding's, "
                      f"the head's and at least one layer each between), not {layout.pp * layout.pp_chunks}.")
    if (layout.tp > hw.gpus_per_node or hw.gpus_per_node % layout.tp) and not cross_node_tp:
        return None, (f"tp={layout.tp} crosses nodes of {hw.gpus_per_node} GPUs (its 4 all-reduces per layer would run "
                      f"on the network)")
    if layout.dp * layout.micro_batch_size * layout.grad_acc != global_seqs:
        return None, (f"the global batch of {global_seqs} sequences is not dp·mbs·grad_acc = {layout.dp}·"
                      f"{layout.micro_batch_size}·{layout.grad_acc}")
    mem = memory_per_gpu(mc, layout, seq_len, dtype, recipe)
    if mem["total"] > hw.memory:
        parts = ", ".join(f"{k} {mem[k] / GiB:.1f}" for k in ("params", "grads", "optimizer", "activations"))
        return mem, f"does not fit: {mem['total'] / GiB:.1f} GiB > {hw.memory / GiB:.1f} GiB ({parts})"
    return mem, None


def _indivisible(global_seqs, layout):
    return (f"the global batch of {global_seqs} sequences is not divisible by dp·mbs = {layout.dp}·"
            f"{layout.micro_batch_size}")


SPACE = dict(  # what `candidates` enumerates; a run's `available` narrows it
    max_tp=None,  # None: a node
    cp=(1, 2, 4, 8, 16),
    zero=(0, 1, 2, 3),
    sp=(False, True),
    recompute=("none", "selective", "full"),
    schedules=(("1f1b", 1), ("interleaved", 2), ("dualpipe", 1)),
    micro_batches=(1, 2, 4, 8),
    cp_impls=("ring", "ulysses"),  # with cp > 1
    async_tp=(False,),  # (False, True): also each sp layout with the collective matmul (picotron.async_tp)
    hsdp=True,  # with ZeRO, also HSDP's shard groups that lie in one node (`shard_sizes`)
)


def shard_sizes(dp, cp, tp, pp, node):
    """HSDP's dp_shard values the search tries for a ZeRO layout: 0 (ZeRO over all of dp x cp) and each proper divisor
    of dp whose shard group lies in one node (time_model.shard_span divides it), the point of HSDP: ZeRO's traffic on
    NVLink, only the replicas' all-reduce on the network. (dp_shard = 1 shards over cp alone: it needs cp > 1.)"""
    return [0] + [k for k in _divisors(dp) if k < dp and (k > 1 or cp > 1)
                  and node % shard_span(Layout(dp=dp, cp=cp, tp=tp, pp=pp, dp_shard=k)) == 0]


def candidates(mc, gpus, hw, seq_len, global_seqs, space=None):
    """Every layout of the job in `space` (SPACE by default): tp dividing a node (or whole nodes up to max_tp), cp, pp
    up to the layers,
    dp = the rest, ep (MoE), micro-batch size, ZeRO stage, sp, recomputation, pipeline schedule. A micro-batch size
    that does not divide the batch comes out once, with grad_acc = 0."""
    sp_ = {**SPACE, **(space or {})}
    node = hw.gpus_per_node
    for tp in (k for k in _divisors(gpus, sp_["max_tp"] or node) if (node % k == 0 if k <= node else k % node == 0)):
        for cp in (k for k in _divisors(gpus // tp) if k in sp_["cp"]):
            for pp in _divisors(gpus // (tp * cp), mc.num_hidden_layers):
                dp = gpus // (tp * cp * pp)
                for ep in (_divisors(math.gcd(dp, mc.num_local_experts)) if mc.is_moe else [1]):
                    for mbs in sp_["micro_batches"]:
                        if global_seqs % (dp * mbs):
                            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch_size=mbs, grad_acc=0)
                            continue
                        ga = global_seqs // (dp * mbs)
                        for zero, shard in ((z, k) for z in sp_["zero"] for k in
                                            (shard_sizes(dp, cp, tp, pp, node) if z and sp_["hsdp"] else [0])):
                            for sp in (sp_["sp"] if tp > 1 else (False,)):
                                for recompute in sp_["recompute"]:
                                    for sched, v in (sp_["schedules"] if pp > 1 else (("1f1b", 1),)):
                                        for impl in (sp_["cp_impls"] if cp > 1 else ("ring",)):
                                            for atp in (sp_["async_tp"] if sp else (False,)):
                                                yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, zero=zero,
                                                             pp_schedule=sched, pp_chunks=v, cp_impl=impl,
                                                             micro_batch_size=mbs, grad_acc=ga, recompute=recompute,
                                                             async_tp=atp, dp_shard=shard)


@dataclass
class Plan:
    ranked: list  # [(layout, memory row, time row)], fastest first
    rejected: list  # [(layout, reason)]
    short: list = field(default_factory=list)  # [(layout, memory row)]: the rejected ones refused for memory alone


def search(mc, gpus, hw, seq_len, global_seqs, dtype="bf16", recipe="mixed", space=None, rules=True):
    """Rank every feasible layout by predicted tokens/s (ties: less memory, then fewer strategies); keep each rejected
    one's reason. tp wider than a node is searched only when space["max_tp"] asks for it (then it runs, flagged).
    `rules`: refuse what picotron's trainer refuses (check_layout)."""
    ranked, rejected, short = [], [], []
    cross = bool(space and (space.get("max_tp") or 0) > hw.gpus_per_node)
    for layout in candidates(mc, gpus, hw, seq_len, global_seqs, space):
        if layout.grad_acc == 0:
            rejected.append((layout, _indivisible(global_seqs, layout)))
            continue
        mem, why = check_layout(mc, layout, seq_len, hw, global_seqs, dtype, recipe, cross_node_tp=cross, rules=rules)
        if why:
            rejected.append((layout, why))
            if mem is not None:  # everything but its memory would run
                short.append((layout, mem))
        else:
            ranked.append((layout, mem, step_time(mc, layout, seq_len, hw, dtype, recipe)))
    ranked.sort(key=lambda r: (-float(f"{r[2]['tokens_per_s']:.9g}"), r[1]["total"], _complexity(r[0])))
    return Plan(ranked, rejected, short)


# ------------------------------------------------------------------------------------- when no layout fits
def least_memory(plan):
    """(layout, memory row) of the layout needing the least memory per GPU among those refused for memory alone (every
    other rule holds), or None: what the job needs at the least, whatever the layout."""
    return min(plan.short, key=lambda r: r[1]["total"], default=None)


def counts_above(gpus, per_node):
    """The GPU counts above `gpus` a job may take, in order: below a node the divisors of a node (tp's rule), then
    whole nodes."""
    n = gpus + 1
    while True:
        if n % per_node == 0 or (n < per_node and per_node % n == 0):
            yield n
        n += 1


def fewest_gpus(mc, gpus, hw, seq_len, global_seqs, dtype="bf16", recipe="mixed", space=None, tries=16):
    """(n, plan at n): the fewest GPUs above `gpus` at which a layout fits, or (None, the last count searched) after
    `tries` searches. A count whose GPUs together cannot hold the model states (RECIPES' bytes per parameter: each
    parameter's are held at least once, so some GPU holds at least their n-th part) is skipped without a search."""
    states = sum(RECIPES[recipe]) * mc.num_params() * (1 - 1e-6)  # (1e-6: tp's cuts round a few elements down)
    for n in counts_above(gpus, hw.gpus_per_node):
        if states / n > hw.memory:
            continue
        found = search(mc, n, hw, seq_len, global_seqs, dtype, recipe, space)
        tries -= 1
        if found.ranked or tries == 0:
            return (n if found.ranked else None), (found if found.ranked else n)


def bounding(mc, plan, least, seq_len, hw, global_seqs, dtype="bf16", recipe="mixed", space=None):
    """The layouts refused for a rule, not for memory, that would need less memory than `least` (a memory row): the
    rules that bound the answer. A refusal whose layouts would need more (or whose shapes leave no memory to count:
    tp not dividing the heads, the batch) changes nothing: lift it and still no layout fits."""
    cross = bool(space and (space.get("max_tp") or 0) > hw.gpus_per_node)
    out = []
    for layout, why in plan.rejected:
        if layout.grad_acc == 0 or why.startswith("does not fit"):
            continue
        mem, _ = check_layout(mc, layout, seq_len, hw, global_seqs, dtype, recipe, cross_node_tp=cross, rules=False)
        if mem is not None and mem["total"] < least["total"]:
            out.append((layout, why, mem))
    return out


def _complexity(layout):
    return (sum(getattr(layout, k) > 1 for k in ("tp", "pp", "cp", "ep")) + layout.sp + layout.zero,
            str(layout))


def rank_of(plan, layout):
    """1-based rank of `layout` in the plan, or None if it was not a candidate or was rejected."""
    return next((i for i, (lay, _, _) in enumerate(plan.ranked, 1) if lay == layout), None)


def why_faster(slow, fast):
    """One clause: the parts of the step where `fast` (a step_time row) saves the most time over `slow`."""
    gains = sorted(((slow[k] - fast[k], k) for k in ("compute", "tp", "cp", "ep", "pp", "bubble", "dp")), reverse=True)
    said = [f"{k} {slow[k]:.2f} -> {fast[k]:.2f} s" for g, k in gains if g > 0.02 * slow["total"]][:3]
    return ", ".join(said) or "about the same parts"

