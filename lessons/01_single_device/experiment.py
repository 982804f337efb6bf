"""Lesson 01, the experiment: where the memory and the time of one training step go on ONE device, and what the
three single-device tools (activation recomputation, gradient accumulation, bf16 autocast) buy and cost.

    python lessons/01_single_device/experiment.py --out runs/lessons/01_single_device [--only memory,allocator]
    torchrun --nproc_per_node 1 lessons/01_single_device/experiment.py --out ...      # the same, under torchrun
    PICOTRON_FAST=1 python lessons/01_single_device/experiment.py ...                 # short settings

Each experiment writes OUT/<name>.json, which the notebook plots:
    memory      one real training step per (model size, sequence length, dtype): the COUNTED bytes of params,
                grads and optimizer state (walking the tensors) and of the tensors autograd saves for backward
                (a saved-tensor hook), next to picotron.planner.memory_estimate
    allocator   what the allocator itself holds while the model is built and trained for two steps, from
                torch.profiler (profile_memory=True): memory in use over time, cut at the phases, next to the
                counted bytes (on a GPU also max_memory_allocated and a memory-history snapshot)
    recompute   none / selective / full, for sdpa and eager attention: saved bytes, forward+backward time,
                and loss and gradients compared with no recomputation
    accumulate  one batch of B sequences vs m micro-batches of B/m: gradients and saved bytes
    precision   fp32 vs bf16 autocast: two short runs of picotron.train (loss curves, tokens/s, memory)
    throughput  tokens/s and MFU against the measured matmul peak for a few model sizes (picotron.train)
    trace       one steady training step under torch.profiler: OUT/trace_step.json (a Chrome/Perfetto trace)
                and each operator's self time by phase
    profile     the trainer's own --profile 2:3 (picotron.trace): OUT/profile_run/traces/rank0.json, each phase's
                time read back from it, the steps' time from metrics.jsonl beside it (on CUDA also the memory
                snapshot, memory_rank0.pickle)
The notebook imports `saved_tensors_table`, `peak_bound` and the plot_* functions; check.py uses `step_memory`.
"""
import bisect
import functools
import gc
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/
import _common  # noqa: E402  (puts the repository root on sys.path)

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from picotron import data, metrics, planner  # noqa: E402
from picotron import train as trainer  # noqa: E402
from picotron.config import Config  # noqa: E402
from picotron.mesh import Mesh  # noqa: E402
from picotron.model import DecoderLayer, rope_cos_sin  # noqa: E402
from picotron.parallelize import parallelize  # noqa: E402

# Model sizes of the sweeps: the "tiny" preset (byte vocabulary) widened and deepened.
SIZES = {
    "tiny": {},
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6),
}
GPU_SIZES = {"smollm-135m": dict(preset="smollm-135m"), "smollm-360m": dict(preset="smollm-360m")}
MB = 2**20


# ------------------------------------------------------------------------ the saved-tensor table
def saved_tensors_table(model_config, seq_len=16, batch=2, dtype="fp32", recompute="none"):
    """Every tensor autograd saves in ONE decoder layer's forward: module, op, shape, dtype, bytes, note.

    Forward pre/post hooks keep track of the current sub-module, a TorchFunctionMode remembers the torch
    function being called, and a saved-tensor hook records what autograd keeps.
    A storage already saved counts once (note "same storage"); parameters are not activations."""
    torch.manual_seed(0)
    layer = DecoderLayer(model_config)
    stack, current, rows, seen = ["layer"], [""], [], set()
    for name, module in layer.named_modules():
        if name:
            module.register_forward_pre_hook(lambda m, a, n=name: stack.append(n))
            module.register_forward_hook(lambda m, a, o: stack.pop() and None)
    params = {p.untyped_storage().data_ptr(): n for n, p in layer.named_parameters()}
    shapes = {tuple(p.shape) for p in layer.parameters()}
    x = torch.randn(batch, seq_len, model_config.hidden_size, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(seq_len), model_config.head_dim, model_config.rope_theta)
    rope = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}

    class RememberOp(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            current[0] = getattr(func, "__name__", str(func)).strip("_")
            return func(*args, **(kwargs or {}))

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        note, nbytes, base = "", t.untyped_storage().nbytes(), t if t._base is None else t._base
        if ptr in params:
            note, nbytes = f"parameter {params[ptr]}: not an activation", 0
        elif ptr in seen:
            note, nbytes = "same storage as a tensor above", 0
        elif ptr in rope:
            note = "RoPE table: one for all layers"
        elif t.dtype == torch.bfloat16 and base.dim() == 2 and tuple(base.shape) in shapes:  # W.t() of a copy
            note = "autocast's bf16 copy of the weight"
        seen.add(ptr)
        rows.append(dict(module=stack[-1], op=current[0], shape=tuple(t.shape),
                         dtype=str(t.dtype).replace("torch.", ""), bytes=nbytes, note=note))
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    with autocast, RememberOp(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if recompute == "full":
            torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
        else:
            layer(x, cos, sin, selective=recompute == "selective")
    return rows


def print_table(rows):
    print(f"{'module':<26}{'op':<30}{'shape':<18}{'dtype':<10}{'bytes':>9}  note")
    for r in rows:
        print(f"{r['module']:<26}{r['op']:<30}{str(r['shape']):<18}{r['dtype']:<10}{r['bytes']:>9,}  {r['note']}")
    print(f"{'total (each storage once, parameters excluded)':<84}{sum(r['bytes'] for r in rows):>9,}")


def by_part(rows):
    """Sum the table's bytes by part of the layer, in planner.activation_terms_per_layer's names."""
    parts = {}
    for r in rows:
        if r["note"].startswith("autocast"):
            part = "bf16 weight copies"
        elif r["note"].startswith("RoPE"):
            part = "RoPE tables (shared)"
        else:
            part = r["module"].split(".")[0]
        parts[part] = parts.get(part, 0) + r["bytes"]
    return parts


# ------------------------------------------------------------------------------- one real step
def make_cfg(size="tiny", **kw):
    overrides = dict(SIZES[size] if size in SIZES else GPU_SIZES[size])
    return Config(**{"preset": "tiny", "sample_tokens": 0, **overrides, **kw})


@functools.lru_cache(maxsize=1)
def shakespeare_tokens():
    tok = data.get_tokenizer("byte")
    return data.TokenData(tok.encode_tensor(data.load_text("shakespeare")), tok.vocab_size)


def batches(cfg, step=1):
    """The trainer's own data: step `step`'s micro-batches of the embedded Shakespeare (byte tokens)."""
    loader = data.DataLoader(shakespeare_tokens(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                             grad_acc=cfg.grad_acc, seed=cfg.seed)
    return loader.micro_batches(step)


def train_step(run, micro, keep_grads=False):
    """One optimizer step as the trainer takes it (without clipping and the lr schedule): the step engine
    (`run.schedule`: loss / k per micro-batch, gradients adding up in p.grad, bf16 autocast if cfg.dtype says
    so), then AdamW, then the gradients are dropped. Returns the loss, the COUNTED bytes (params and grads
    walked before the optimizer step, AdamW's state after it, the saved tensors of the first micro-batch) and,
    with keep_grads, a copy of the gradients."""
    activations = run.schedule.phases.listen(metrics.ActivationPeak(run.model))  # as the trainer counts them
    loss = float(run.schedule.run(run.model, micro, run.loss_fn))  # float(): waits for the device
    run.schedule.phases.forget(activations)
    counted = run.model.memory()
    grads = [p.grad.detach().clone() for p in run.raw.parameters()] if keep_grads else None
    with record_function("optimizer"):
        run.optimizer.step()
        run.model.zero_grad(set_to_none=True)
    counted.update(optimizer=metrics.optimizer_bytes(run.optimizer), activations=activations.bytes)
    return loss, counted, grads


def measure(cfg, device, steps=1, keep_grads=False):
    """`steps` real training steps of a freshly initialised model on the same batch, on ONE device
    (`Mesh.local`: no process group): the counted memory by category, the fastest steady step time, the
    first step's loss (and gradients)."""
    run, micro, times = parallelize(cfg, Mesh.local(device)), batches(cfg), []
    for step in range(steps):
        t0 = time.perf_counter()
        loss, mem, grads = train_step(run, micro, keep_grads and step == 0)
        metrics.sync(device)
        times.append(time.perf_counter() - t0)
        if step == 0:
            first = dict(loss=loss, grads=grads)
    steady = times[1:] or times  # the first step pays for allocations, AdamW's state and kernel selection
    return dict(mem=mem, time=min(steady), **first)


def row(cfg, size, result):
    mc = cfg.model_config()
    est = planner.memory_estimate(mc, cfg.seq_len, cfg.micro_batch_size, cfg.dtype, cfg.recompute)
    return dict(size=size, n_params=mc.num_params(), seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                grad_acc=cfg.grad_acc, dtype=cfg.dtype, recompute=cfg.recompute, attn_impl=mc.attn_impl,
                counted=result["mem"], estimate=est, time=result["time"], loss=result["loss"])


def max_abs_diff(tensors, reference):
    return max((t - r).abs().max().item() for t, r in zip(tensors, reference))


# -------------------------------------------------------------- the allocator's view (torch.profiler)
PHASES = ("forward", "backward", "optimizer")


def profiler_phase(name, **info):
    """A listener on the step engine's phases (`schedule.OneStage.phases`, picotron.hooks): each micro-batch's
    forward and backward become named ranges of the profiler's trace, so memory and time can be cut at them."""
    return record_function(name)


def activities(device):
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def step_memory(cfg, device, steps=2, timeline=False, snapshot=None, timed_steps=0):
    """What the allocator holds while the model of `cfg` is built and trained for `steps` steps on `device`.

    torch.profiler with profile_memory=True records every allocation and free on the device; their running
    sum is the memory in use. The data are loaded before the profiler starts (and Python is not a tensor),
    so the sum is exactly what building and training the model allocates. Returns, per step, the memory in
    use at its start, after its first forward, when its optimizer step starts and at its end, its peak and
    the operator running at the peak; the counted bytes (`train_step`); with `timeline`, the memory over time
    and the phases. CUDA: also the caching allocator's max_memory_allocated/reserved per step and, with
    `snapshot` (a path), a memory-history snapshot for https://pytorch.org/memory_viz. `timed_steps` more
    steps without the profiler give tokens/s."""
    micro, cuda = batches(cfg), device.type == "cuda"
    gc.collect()  # a tensor allocated while an earlier profile ran and freed during this one would count as a free
    if cuda and snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    caching = []
    with profile(activities=activities(device), profile_memory=True) as prof:
        with record_function("build"):
            run = parallelize(cfg, Mesh.local(device))
        run.schedule.phases.listen(profiler_phase)
        for step in range(1, steps + 1):
            metrics.reset_device_peak(device)
            with record_function(f"step {step}"):
                _, counted, _ = train_step(run, micro)
            if cuda:
                caching.append(dict(allocated=torch.cuda.max_memory_allocated(device),
                                    reserved=torch.cuda.max_memory_reserved(device)))
    if cuda and snapshot:
        torch.cuda.memory._dump_snapshot(str(snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
    result = dict(memory_in_use(prof.profiler.kineto_results.events(), device, steps, timeline),
                  counted=counted, cuda=caching or None)
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        train_step(run, micro)
        times.append(time.perf_counter() - t0)
    if times:
        result["tokens_per_s"] = cfg.tokens_per_step / min(times)
    return result


def memory_in_use(events, device, steps, timeline=False, bins=1500):
    """`step_memory`'s analysis of the profiler's events (kineto's, times in ns): "[memory]" events carry the
    bytes allocated (> 0) or freed (< 0) on a device; our ranges ("build", "step n", "forward", ...) cut them."""
    kind = device.type.upper()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and str(e.device_type()).endswith(kind))
    t, level = [m[0] for m in mem], list(itertools.accumulate(n for _, n in mem))
    ranges, ops = [], []
    for e in events:
        name = e.name()
        if name == "[memory]" or not str(e.device_type()).endswith("CPU"):  # ranges and operators, not GPU kernels
            continue
        if name in ("build", *PHASES) or name.startswith("step "):
            ranges.append((e.start_ns(), e.end_ns(), name))
        else:
            ops.append((e.start_ns(), e.end_ns(), name))
    ranges.sort()

    def before(ns):  # memory in use just before time ns
        i = bisect.bisect_left(t, ns) - 1
        return level[i] if i >= 0 else 0

    def after(ns):
        i = bisect.bisect_right(t, ns) - 1
        return level[i] if i >= 0 else 0

    def running_at(ns):
        """The innermost operator running at ns, and the autograd node (backward) it belongs to."""
        around = [o for o in ops if o[0] <= ns <= o[1]]
        node = [o[2].split(": ")[-1] for o in around if o[2].startswith("autograd::engine::evaluate_function")]
        inner = min(around, key=lambda o: o[1] - o[0])[2] if around else "?"
        return inner + (f" in {min(node, key=len)}" if node else "")

    build = next(r for r in ranges if r[2] == "build")
    out = dict(after_build=after(build[1]), steps=[])
    for n in range(1, steps + 1):
        s0, s1, _ = next(r for r in ranges if r[2] == f"step {n}")
        inside = [r for r in ranges if s0 <= r[0] and r[1] <= s1 and r[2] in PHASES]
        i, j = bisect.bisect_left(t, s0), bisect.bisect_right(t, s1)
        k = max(range(i, j), key=level.__getitem__)
        out["steps"].append(dict(
            start=before(s0), end=after(s1), peak=level[k], peak_op=running_at(t[k]),
            peak_phase=next((r[2] for r in inside if r[0] <= t[k] <= r[1]), "between phases"),
            after_forward=after(next(r for r in inside if r[2] == "forward")[1]),
            before_optimizer=before(next(r for r in inside if r[2] == "optimizer")[0])))
    if timeline:  # the most memory in use in each of `bins` slices of time: peaks survive the thinning
        t0, t1 = build[0], max(r[1] for r in ranges)
        edges = [t0 + (t1 - t0) * q / bins for q in range(bins + 1)]
        out["timeline"] = dict(ms=[(a - t0) / 1e6 for a in edges[:-1]], bytes=[
            max([before(a)] + level[bisect.bisect_left(t, a):bisect.bisect_right(t, b)]) for a, b in zip(edges, edges[1:])],
            phases=[(name, (a - t0) / 1e6, (b - t0) / 1e6) for a, b, name in ranges])
    return out


def peak_bound(mc, seq_len, micro_batch_size, dtype="fp32", recompute="none"):
    """A rule of thumb for the allocator's peak in a steady step (section 4b checks it): the planner's count
    (params + grads + AdamW state + saved tensors) plus the backward's working set. The backward of a layer
    holds gradients of what the layer saved: at most one layer's saved tensors without recomputation (L1).
    Recomputation brings back, for one layer at a time, what it dropped: the whole layer's L1 (full) or the
    attention block's share of it (selective). The loss adds two fp32 logits-sized gradients (4·s·b·v each)."""
    s, b = seq_len, micro_batch_size
    layer = planner.activation_terms_per_layer(mc, s, b, dtype)
    again = {"none": 0, "selective": layer["self_attn"], "full": sum(layer.values())}[recompute]
    working = sum(layer.values()) + again + 2 * 4 * s * b * mc.vocab_size
    return planner.memory_estimate(mc, s, b, dtype, recompute)["total"] + working


# ---------------------------------------------------------------------------- where the time goes
def self_time_by_phase(events, device, top=6):
    """Each operator's self time (its own, not that of the operators it calls; on a GPU, the time of the
    kernels it launched) summed by name within each phase. On a CPU the phase's own self time is the time
    between operators: Python and the autograd engine's bookkeeping."""
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in events if e.device_type == DeviceType.CPU]  # operators (their kernels count in their time)
    out = {}
    for mark in (e for e in events if e.name in PHASES):
        lo, hi = mark.time_range.start, mark.time_range.end
        total = {}
        for e in events:
            if e.name in PHASES or e.name == "step" or not lo <= e.time_range.start < hi:
                continue
            name = "autograd engine" if e.name.startswith("autograd::engine") else e.name
            total[name] = total.get(name, 0) + getattr(e, key)
        if device.type != "cuda":
            total["(between operators)"] = mark.self_cpu_time_total
        ranked = sorted(total.items(), key=lambda kv: -kv[1])
        out[mark.name] = dict(wall_ms=(hi - lo) / 1e3, self_ms=sum(total.values()) / 1e3,
                              top=[(name, us / 1e3) for name, us in ranked[:top]],
                              other_ms=sum(us for _, us in ranked[top:]) / 1e3)
    return out


# --------------------------------------------------------------------------------- experiments
def settings(fast, device_type=None):
    """Each experiment's sizes (FAST or full); on GPUs, _common.GPU_SETTINGS["01_single_device"] on top (the
    throughput runs in bf16 at s = 1024, with the SmolLM models too; what counts bytes keeps its CPU sizes)."""
    st = dict(memory_sizes=("tiny", "small") if fast else ("tiny", "small", "medium"),
              memory_seqs=(64, 128, 256) if fast else (128, 256, 512), memory_micro_batch_size=2 if fast else 8,
              allocator_seq_len=256 if fast else 512, allocator_micro_batch_size=4 if fast else 8,
              recompute_seq_len=256 if fast else 512, recompute_micro_batch_size=2 if fast else 8,
              recompute_steps=4 if fast else 6,
              accumulate_global_batch=8 if fast else 32, accumulate_seq_len=128 if fast else 256,
              accumulate_ks=(1, 2, 4, 8) if fast else (1, 2, 4, 8, 16),
              precision_steps=20 if fast else 100, precision_seq_len=64 if fast else 128,
              precision_micro_batch_size=4 if fast else 8,
              throughput_sizes=("tiny", "small") if fast else ("tiny", "small", "medium"),
              throughput_seq_len=128 if fast else 256, throughput_micro_batch_size=8, throughput_steps=4 if fast else 10,
              throughput_dtype="fp32",  # CPUs without bf16 units emulate it (see the precision experiment)
              trace_seq_len=256 if fast else 512, trace_micro_batch_size=4 if fast else 8,
              profile_seq_len=128 if fast else 256, profile_micro_batch_size=4)
    return _common.sized("01_single_device", st, fast, device_type)


def exp_memory(mesh, fast, out):
    st = settings(fast, mesh.device.type)
    sizes, seqs, b = st["memory_sizes"], st["memory_seqs"], st["memory_micro_batch_size"]
    rows = []
    for size, seq, dtype in [(s, L, "fp32") for s in sizes for L in seqs] + [("tiny", L, "bf16") for L in seqs]:
        cfg = make_cfg(size, seq_len=seq, micro_batch_size=b, dtype=dtype)
        rows.append(row(cfg, size, measure(cfg, mesh.device)))
        r = rows[-1]
        print(f"memory  {size:<7}{dtype:<5} s={seq:<4} counted saved tensors {r['counted']['activations']:>12,} "
              f"B, planner {r['estimate']['activations']:>12,} B", flush=True)
    return rows


def exp_allocator(mesh, fast, out):
    st = settings(fast, mesh.device.type)
    seq, b = st["allocator_seq_len"], st["allocator_micro_batch_size"]
    rows = []
    for j, (recompute, mb, k) in enumerate([("none", b, 1), ("full", b, 1), ("none", b // 2, 2)]):
        cfg = make_cfg("small", seq_len=seq, micro_batch_size=mb, grad_acc=k, recompute=recompute)
        snapshot = Path(out) / "memory_snapshot.pickle" if j == 0 and mesh.device.type == "cuda" else None
        r = step_memory(cfg, mesh.device, timeline=j == 0, snapshot=snapshot)
        mc = cfg.model_config()
        r.update(size="small", seq_len=seq, micro_batch_size=mb, grad_acc=k, recompute=recompute,
                 vocab_size=mc.vocab_size, snapshot=str(snapshot) if snapshot else None,
                 estimate=planner.memory_estimate(mc, seq, mb, cfg.dtype, recompute),
                 layer=planner.activation_bytes_per_layer(mc, seq, mb, cfg.dtype),
                 bound=peak_bound(mc, seq, mb, cfg.dtype, recompute))
        rows.append(r)
        last = r["steps"][-1]
        print(f"allocator  recompute {recompute:<5} micro-batch {mb} x {k}: last step's peak {last['peak'] / MB:7.2f} MiB "
              f"({last['peak_phase']}, {last['peak_op']}) | counted total {r['estimate']['total'] / MB:7.2f} MiB", flush=True)
    return rows


def exp_recompute(mesh, fast, out):
    st = settings(fast, mesh.device.type)
    seq, b, steps = st["recompute_seq_len"], st["recompute_micro_batch_size"], st["recompute_steps"]
    rows = []
    for impl in ("sdpa", "eager"):
        ref = None
        for mode in ("none", "selective", "full"):
            cfg = make_cfg("small", seq_len=seq, micro_batch_size=b, recompute=mode, attn_impl=impl)
            res = measure(cfg, mesh.device, steps=steps, keep_grads=True)
            ref = ref or res
            r = row(cfg, "small", res)
            r.update(max_grad_diff=max_abs_diff(res["grads"], ref["grads"]), loss_diff=abs(res["loss"] - ref["loss"]))
            rows.append(r)
            print(f"recompute {impl:<6}{mode:<10} counted saved tensors {r['counted']['activations']:>12,} B | "
                  f"step {1e3 * r['time']:7.1f} ms | max |grad - grad(none)| {r['max_grad_diff']:.1e}", flush=True)
    return rows


def exp_accumulate(mesh, fast, out):
    st = settings(fast, mesh.device.type)
    global_batch, seq, ks = st["accumulate_global_batch"], st["accumulate_seq_len"], st["accumulate_ks"]
    rows, ref = [], None
    for k in ks:
        cfg = make_cfg("tiny", seq_len=seq, micro_batch_size=global_batch // k, grad_acc=k)
        res = measure(cfg, mesh.device, steps=3, keep_grads=True)
        ref = ref or res
        r = row(cfg, "tiny", res)
        r.update(max_grad_diff=max_abs_diff(res["grads"], ref["grads"]), loss_diff=abs(res["loss"] - ref["loss"]),
                 max_grad=max(g.abs().max().item() for g in ref["grads"]))
        rows.append(r)
        print(f"accumulate m={k:<3} micro-batch {global_batch // k:<3} counted saved tensors {r['counted']['activations']:>11,}"
              f" B | step {1e3 * r['time']:6.1f} ms | max |grad - grad(m=1)| {r['max_grad_diff']:.1e}", flush=True)
    return rows


def exp_precision(mesh, fast, out):
    st = settings(fast, mesh.device.type)
    steps, seq, b = st["precision_steps"], st["precision_seq_len"], st["precision_micro_batch_size"]
    runs = {}
    for dtype in ("fp32", "bf16"):
        cfg = make_cfg("tiny", steps=steps, seq_len=seq, micro_batch_size=b, dtype=dtype, warmup_steps=max(1, steps // 10),
                       eval_every=max(1, steps // 4), log_every=max(1, steps // 4), out=str(Path(out) / f"precision_{dtype}"))
        trainer.train(cfg, mesh)
        history, summary = metrics.read_metrics(cfg.out)
        runs[dtype] = dict(steps=[r["step"] for r in history], loss=[r["loss"] for r in history],
                           grad_norm=[r["grad_norm"] for r in history],
                           val=[(r["step"], r["val_loss"]) for r in history if "val_loss" in r],
                           summary=summary, estimate=planner.memory_estimate(cfg.model_config(), seq, b, dtype))
    return runs


def exp_throughput(mesh, fast, out):
    st = settings(fast, mesh.device.type)
    seq, b, steps = st["throughput_seq_len"], st["throughput_micro_batch_size"], st["throughput_steps"]
    dtype = st["throughput_dtype"]
    rows = []
    for size in st["throughput_sizes"]:
        cfg = make_cfg(size, steps=steps, seq_len=seq, micro_batch_size=b, dtype=dtype, eval_every=0, log_every=steps,
                       warmup_steps=1, out=str(Path(out) / f"throughput_{size}"))
        summary = trainer.train(cfg, mesh)
        rows.append(dict(size=size, dtype=dtype, seq_len=seq, micro_batch_size=b, **{k: summary[k] for k in (
            "num_params", "tokens_per_s", "mfu", "flops_per_token", "peak_flops_measured", "peak_flops_datasheet")}))
    return rows


def exp_trace(mesh, fast, out):
    st = settings(fast, mesh.device.type)
    seq, b = st["trace_seq_len"], st["trace_micro_batch_size"]
    cfg, device = make_cfg("small", seq_len=seq, micro_batch_size=b), mesh.device
    run, micro = parallelize(cfg, Mesh.local(device)), batches(cfg)
    run.schedule.phases.listen(profiler_phase)
    train_step(run, micro)  # a first step: AdamW creates its state, kernels are chosen
    with profile(activities=activities(device)) as prof:
        with record_function("step"):
            train_step(run, micro)
    path = Path(out) / "trace_step.json"
    prof.export_chrome_trace(str(path))
    phases = self_time_by_phase(prof.events(), device)
    for name, p in phases.items():
        print(f"trace  {name:<10} {p['wall_ms']:8.1f} ms | " + ", ".join(f"{n} {ms:.1f}" for n, ms in p["top"][:3]), flush=True)
    return dict(trace=str(path), trace_mb=path.stat().st_size / 1e6, size="small", seq_len=seq, micro_batch_size=b,
                time="device" if device.type == "cuda" else "cpu", phases=phases)


def exp_profile(mesh, fast, out):
    """`--profile 2:3` of a 3-step run of the small model, 2 micro-batches a step: what the trainer writes, read back."""
    from picotron import trace

    st = settings(fast, mesh.device.type)
    folder = Path(out) / "profile_run"
    cfg = make_cfg("small", steps=3, seq_len=st["profile_seq_len"], micro_batch_size=st["profile_micro_batch_size"],
                   grad_acc=2, eval_every=0, log_every=3, warmup_steps=1, profile="2:3", out=str(folder))
    trainer.train(cfg, mesh)
    path = folder / "traces" / "rank0.json"
    rows = trace.phases(_common.load_json(path))
    step_ms = {int(name.split()[1]): (end - start) / 1e3 for _, name, start, end, _ in rows if name.startswith("step ")}
    spans = {int(name.split()[1]): (start, end) for _, name, start, end, _ in rows if name.startswith("step ")}
    phases, by_step = {}, {s: 0.0 for s in spans}  # kind -> total ms over the profiled steps; step -> its phases' ms
    for _, name, start, end, _ in rows:
        kind = name.split(" mb=")[0] if " mb=" in name else name
        if not name.startswith(("step ", trace.START)):
            phases[kind] = phases.get(kind, 0.0) + (end - start) / 1e3
            step = next(s for s, (a, b) in spans.items() if a <= start <= b)
            by_step[step] += (end - start) / 1e3
    records = {r["step"]: r["step_time"] * 1e3 for r in metrics.read_metrics(str(folder))[0]}
    snapshot = folder / "traces" / "memory_rank0.pickle"
    return dict(trace=str(path), trace_mb=path.stat().st_size / 1e6, steps=sorted(step_ms), step_ms=step_ms,
                metrics_step_ms={s: records[s] for s in step_ms}, phases=phases, phases_by_step=by_step,
                snapshot=str(snapshot) if snapshot.exists() else None, device=mesh.device.type,
                seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, grad_acc=cfg.grad_acc)


# ------------------------------------------------------------------------ plots (for the notebook)
PARTS = ("params", "grads", "optimizer", "activations")
LABELS = dict(params="params", grads="grads", optimizer="optimizer state", activations="activations (counted saved tensors)")
COLORS = dict(params="#4c72b0", grads="#dd8452", optimizer="#55a868", activations="#c44e52")
PHASE_COLORS = dict(build="#bbbbbb", forward="#4c72b0", backward="#dd8452", optimizer="#55a868")


def stacked_bar(ax, x, breakdown, width=0.38, hatch=None, label=True, scale=MB):
    bottom = 0
    for part in PARTS:
        ax.bar(x, breakdown[part] / scale, width, bottom=bottom, color=COLORS[part], hatch=hatch,
               edgecolor="white", label=LABELS[part] if label else None)
        bottom += breakdown[part] / scale


def plot_memory(rows):
    """Counted (solid) beside planner (hatched) stacked bars, one pair per (size, dtype, seq)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 3.8))
    for j, r in enumerate(rows):
        stacked_bar(ax, j - 0.2, r["counted"], label=j == 0)
        stacked_bar(ax, j + 0.2, r["estimate"], hatch="//", label=False)
    ax.set_xticks(range(len(rows)), [f"{r['size']}\n{r['dtype']} s={r['seq_len']}" for r in rows], fontsize=8)
    ax.set_ylabel("MiB (counted tensor bytes)")
    ax.set_title(f"One training step, micro-batch {rows[0]['micro_batch_size']}: counted (left) vs "
                 "planner.memory_estimate (right, hatched)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_allocator_timeline(r):
    """Memory in use (the allocator, via torch.profiler) over the build and two steps, phases shaded, with
    the counted levels it should reach."""
    import matplotlib.pyplot as plt

    tl, c, est = r["timeline"], r["counted"], r["estimate"]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for name, a, b in tl["phases"]:
        if name in PHASE_COLORS:
            ax.axvspan(a, b, color=PHASE_COLORS[name], alpha=0.18, lw=0)
    ax.plot(tl["ms"], [x / MB for x in tl["bytes"]], color="k", lw=1.2, drawstyle="steps-post")
    levels = [(c["params"] + c["optimizer"] + c["activations"], "params + optimizer state + counted saved tensors", ":"),
              (est["total"], "counted estimate: params + grads + optimizer + saved tensors", "--"),
              (r["bound"], "peak_bound: estimate + the backward's working set (rule of thumb)", "-.")]
    for y, label, ls in levels:
        ax.axhline(y / MB, color="#8172b2", ls=ls, lw=1)
        ax.text(tl["ms"][0], y / MB, " " + label, fontsize=8, va="bottom", color="#5a4f7c")
    last = r["steps"][-1]
    ax.annotate(f"step 2 peak {last['peak'] / MB:.1f} MiB\n{last['peak_op']}", xy=(tl["ms"][tl["bytes"].index(max(tl["bytes"]))], last["peak"] / MB),
                xytext=(0.99, 0.5), textcoords="axes fraction", ha="right", fontsize=8,
                arrowprops=dict(arrowstyle="->", lw=0.8))
    for name, a, b in tl["phases"]:
        if name.startswith("step "):
            ax.text((a + b) / 2, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=col, alpha=0.3) for col in PHASE_COLORS.values()]
    ax.legend(handles, list(PHASE_COLORS), fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="phase",
              title_fontsize=8)
    ax.set(xlabel="ms since the profiler started (build, step 1, step 2)", ylabel="MiB in use (allocator)",
           ylim=(0, 1.25 * max(r["bound"], max(tl["bytes"])) / MB))
    fig.suptitle(f"What the allocator holds: {r['size']} model, s={r['seq_len']}, micro-batch {r['micro_batch_size']}, "
                 f"fp32, torch.profiler(profile_memory=True)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_allocator_peaks(rows):
    """Per variant: the allocator's peak in step 2 between the counted levels that bracket it."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    labels = [f"recompute {r['recompute']}\nmicro-batch {r['micro_batch_size']} x {r['grad_acc']}" for r in rows]
    bars = [("params + optimizer + saved tensors", lambda r: r["counted"]["params"] + r["counted"]["optimizer"]
             + r["counted"]["activations"], "#c44e52"),
            ("counted estimate (all four)", lambda r: r["estimate"]["total"], "#8172b2"),
            ("allocator peak (step 2)", lambda r: r["steps"][-1]["peak"], "k"),
            ("peak_bound", lambda r: r["bound"], "#bbbbbb")]
    for j, (label, value, color) in enumerate(bars):
        xs = [i + 0.2 * (j - 1.5) for i in range(len(rows))]
        ax.bar(xs, [value(r) / MB for r in rows], 0.2, color=color, label=label)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title(f"{rows[0]['size']} model, s={rows[0]['seq_len']}, global batch "
                 f"{rows[0]['micro_batch_size'] * rows[0]['grad_acc']}: the peak against the counts", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def plot_recompute(rows):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    modes = ["none", "selective", "full"]
    for j, impl in enumerate(("sdpa", "eager")):
        sel = {r["recompute"]: r for r in rows if r["attn_impl"] == impl}
        xs = [m + 0.38 * (j - 0.5) for m in range(3)]
        ax1.bar(xs, [sel[m]["counted"]["activations"] / MB for m in modes], 0.38, label=f"{impl}, counted")
        ax1.plot(xs, [sel[m]["estimate"]["activations"] / MB for m in modes], "k_", ms=18,
                 label="planner" if j == 0 else None)
        ax2.bar(xs, [1e3 * sel[m]["time"] for m in modes], 0.38, label=impl)
    r0 = rows[0]
    ax1.set(xticks=range(3), xticklabels=modes, ylabel="MiB (counted saved tensors)",
            title=f"kept for backward (s={r0['seq_len']}, b={r0['micro_batch_size']})")
    ax2.set(xticks=range(3), xticklabels=modes, ylabel="ms", title="one training step (fastest of a few)")
    ax1.legend(fontsize=8), ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_accumulate(rows):
    import matplotlib.pyplot as plt

    ks = [str(r["grad_acc"]) for r in rows]
    act = [r["counted"]["activations"] / MB for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    ax1.bar(ks, act, color=COLORS["activations"], label="counted")
    ax1.plot(ks, [act[0] / r["grad_acc"] for r in rows], "ko--", label="(m=1) / m")
    ax1.set(xlabel="m micro-batches per step", ylabel="MiB (counted saved tensors)", title="saved for backward, one micro-batch")
    ax1.legend(fontsize=8)
    ax2.bar(ks, [max(r["max_grad_diff"], 1e-12) for r in rows], color="gray")
    ax2.set(yscale="log", ylim=(1e-12, 1), xlabel="m", title="max |grad(m) - grad(m=1)|  (fp32 rounding)")
    fig.tight_layout()
    return fig


def plot_precision(runs):
    import matplotlib.pyplot as plt

    fig, (ax1, ax4, ax2, ax3) = plt.subplots(1, 4, figsize=(14, 3.2), gridspec_kw=dict(width_ratios=[2, 2, 1, 1]))
    for dtype, r in runs.items():
        ax1.plot(r["steps"], r["loss"], label=f"{dtype} train")
        if r["val"]:
            ax1.plot(*zip(*r["val"]), "o--", label=f"{dtype} val")
    ax1.set(xlabel="step", ylabel="loss", title="same seed, same batches")
    ax1.legend(fontsize=8)
    fp32, bf16 = runs["fp32"], runs["bf16"]  # the difference, which the overlapping curves hide
    ax4.plot(fp32["steps"], [b - a for a, b in zip(fp32["loss"], bf16["loss"])], color="#4c72b0",
             label="train (one batch per step)")
    if fp32["val"] and bf16["val"]:
        ax4.plot([s for s, _ in fp32["val"]], [b - a for (_, a), (_, b) in zip(fp32["val"], bf16["val"])], "o--",
                 color="#dd8452", label="validation (held-out mean)")
    ax4.axhline(0, color="k", lw=0.8)
    ax4.set(xlabel="step", ylabel="loss: bf16 − fp32", title="the difference")
    ax4.legend(fontsize=8)
    names = list(runs)
    ax2.bar(names, [runs[d]["summary"]["tokens_per_s"] for d in names], color=["#4c72b0", "#dd8452"])
    ax2.set(title="tokens/s", yscale="log")
    ax3.bar(names, [runs[d]["summary"]["mem"]["activations"] / MB for d in names], color=COLORS["activations"])
    ax3.set(title="MiB (counted saved)")
    fig.tight_layout()
    return fig


def plot_throughput(rows):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    labels = [f"{r['size']}\n{r['num_params'] / 1e6:.1f}M" for r in rows]
    ax1.bar(labels, [r["tokens_per_s"] for r in rows])
    ax1.set(ylabel="tokens/s", title=f"{rows[0]['dtype']}, s={rows[0]['seq_len']}, b={rows[0]['micro_batch_size']}")
    ax2.bar(labels, [100 * r["mfu"] for r in rows], label="of the measured matmul peak")
    if rows[0]["peak_flops_datasheet"]:
        ax2.bar(labels, [100 * r["mfu"] * r["peak_flops_measured"] / r["peak_flops_datasheet"] for r in rows],
                0.5, label="of the datasheet peak")
    ax2.set(ylabel="MFU %", title="model FLOPs utilisation", ylim=(0, 100))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_trace(result):
    """Top operators by self time, one panel per phase."""
    import matplotlib.pyplot as plt

    def short(name, width=26):
        name = name.removeprefix("aten::")
        return name if len(name) <= width else name[:width - 1] + "…"

    phases = [p for p in PHASES if p in result["phases"]]
    fig, axes = plt.subplots(1, len(phases), figsize=(13, 3.4))
    for ax, name in zip(axes, phases):
        p = result["phases"][name]
        items = p["top"] + [("other", p["other_ms"])]
        ax.barh([short(n) for n, _ in items][::-1], [ms for _, ms in items][::-1], color=PHASE_COLORS[name])
        ax.set_title(f"{name}: {p['wall_ms']:.0f} ms", fontsize=10)
        ax.set_xlabel(f"self time, ms ({result['time']})", fontsize=8)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"One steady training step, {result['size']} model, s={result['seq_len']}, "
                 f"micro-batch {result['micro_batch_size']}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_profile(result):
    """The profiled steps' phases (from the trainer's trace), summed over both steps, against the steps' time."""
    import matplotlib.pyplot as plt

    phases = result["phases"]
    names = sorted(phases, key=phases.get, reverse=True)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    ax.barh(names, [phases[n] for n in names], color=[PHASE_COLORS.get(n.split()[0], "#8172b2") for n in names])
    total = sum(result["step_ms"].values())
    ax.axvline(total, color="k", ls="--", lw=1, label=f"steps {result['steps'][0]}-{result['steps'][-1]}: {total:.0f} ms")
    ax.invert_yaxis()
    ax.set_xlabel("ms (summed over the profiled steps and their micro-batches)")
    ax.set_title("picotron's phases, read from OUT/traces/rank0.json (--profile 2:3)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def plot_estimate(estimates, limit_gb=80, title=""):
    """Horizontal stacked bars of planner estimates {label: breakdown} in GB, with a device-memory line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.3 + 0.55 * len(estimates)))
    for j, (label, est) in enumerate(estimates.items()):
        left = 0
        for part in PARTS:
            ax.barh(j, est[part] / 1e9, left=left, color=COLORS[part], label=LABELS[part] if j == 0 else None)
            left += est[part] / 1e9
        ax.text(left, j, f" {left:,.1f} GB", va="center", fontsize=8)
    top = max(sum(est[p] for p in PARTS) for est in estimates.values()) / 1e9
    ax.axvline(limit_gb, color="k", ls="--", lw=1)
    ax.text(limit_gb, -0.5, f" {limit_gb} GB GPU", fontsize=8, va="bottom")
    ax.set_yticks(range(len(estimates)), list(estimates), fontsize=8)
    ax.set(xlim=(0, 1.2 * max(top, limit_gb)), ylim=(len(estimates) - 0.5, -0.5 - 0.6),
           xlabel="GB (10⁹ bytes)", title=title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


EXPERIMENTS = ("memory", "allocator", "recompute", "accumulate", "precision", "throughput", "trace", "profile")


def main(argv=None):
    args, names, out = _common.cli("01_single_device", EXPERIMENTS, __doc__, argv=argv)
    mesh = Mesh.init(device=_common.experiment_device("01_single_device"))
    with mesh:  # on success every rank meets at a barrier before the groups go (Mesh.destroy)
        _common.run_experiments(names, lambda name: globals()[f"exp_{name}"](mesh, args.fast, out),
                                lambda name: out / f"{name}.json", _common.environment(mesh, fast=args.fast))


if __name__ == "__main__":
    main()
