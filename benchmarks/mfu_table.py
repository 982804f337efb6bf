"""The MFU table: every precision recipe, kernel choice and --compile at two real shapes, beside what a learner
would otherwise use (transformers' LlamaForCausalLM trained by a plain loop), on one GPU.

    ./run.sh python benchmarks/mfu_table.py                      # one CUDA GPU (about 15 minutes on an H100/H200)
    ./run.sh python benchmarks/mfu_table.py --shapes smollm-360m # one shape only
    ./run.sh python benchmarks/mfu_table.py --cpu-smoke          # tiny settings on the CPU: proves the script works

Shapes: SmolLM-360M and SmolLM-1.7B at sequence 2048, micro-batch 4, 20 steps (one GPU, no parallelism). Rows per
shape, each one fresh process (`python -m picotron.train`, the same runner as benchmarks/gpu_check.py):
`--dtype bf16` (autocast, SDPA: the baseline), `--compile`, `--kernels triton`, `--attn-impl flash`,
`--dtype bf16-params`, `--dtype fp8` (per-tensor scales), `--dtype fp8 --fp8-recipe blockwise` (DeepSeek-V3's
tiles); and "transformers Llama, same loop": LlamaForCausalLM built from the same config.json
(`ModelConfig.to_dict`), SDPA attention, AdamW, bf16 autocast, gradient clipping at 1.0, the same tokens per step,
timed the same way, once plain and once under torch.compile (the fair opponent of our --compile). tokens/s is the median over the steps after the first five (warm-up,
compilation); MFU = tokens/s × 6N + 12·L·h·s FLOPs per token (PaLM's count, `metrics.flops_per_token`) over the
matmul peak measured on this device in bf16 (`metrics.measured_matmul_peak`) and over the datasheet's
(`metrics.DATASHEET_PEAK_BF16`). "vs bf16" divides a row's tokens/s by the bf16 row's of the same shape.

It prints one table per shape, then each row held to its target (TARGETS: bf16-params >= 1.0x bf16, both FP8
recipes >= 1.1x bf16 at 1.7B, --compile >= 1.3x transformers compiled) with pass or miss, and writes them as JSON
(--out). Without a CUDA GPU it says so in one sentence and
exits 0; --cpu-smoke runs the rows with the tiny preset on the CPU (Triton under its interpreter).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SKIP_STEPS = 5  # steps left out of the medians (allocations, kernel selection, compilation)
GPU = dict(shapes=("smollm-360m", "smollm-1.7b"), seq_len=2048, micro_batch_size=4, steps=20, limit_s=300,
           compile_limit_s=600)
SMOKE = dict(shapes=("tiny",), seq_len=64, micro_batch_size=2, steps=3, limit_s=180, compile_limit_s=300)


def rows(shape, st, device):
    """[(key, label, kind, argv)]: kind "train" (picotron.train's argv) or "hf" (this file's --hf-loop argv)."""
    model = ["--preset", shape, "--seq-len", str(st["seq_len"]), "--micro-batch-size", str(st["micro_batch_size"]),
             "--steps", str(st["steps"]), "--warmup-steps", "1", "--eval-every", "0", "--sample-tokens", "0",
             "--log-every", str(st["steps"]), "--device", device]
    bf16 = model + ["--dtype", "bf16"]
    return [("bf16", "ours --dtype bf16 (autocast, sdpa)", "train", bf16),
            ("hf", "transformers Llama, same loop", "hf", model),
            ("hf-compile", "transformers Llama, torch.compile", "hf", model + ["--compile"]),
            ("compile", "ours --compile", "train", bf16 + ["--compile"]),
            ("triton", "ours --kernels triton", "train", bf16 + ["--kernels", "triton"]),
            ("flash", "ours --attn-impl flash", "train", bf16 + ["--attn-impl", "flash"]),
            ("bf16-params", "ours --dtype bf16-params", "train", model + ["--dtype", "bf16-params"]),
            ("fp8", "ours --dtype fp8", "train", model + ["--dtype", "fp8"]),
            ("fp8-block", "ours --dtype fp8 --fp8-recipe blockwise", "train",
             model + ["--dtype", "fp8", "--fp8-recipe", "blockwise"])]


# (row, the row it is divided by, at least, the shapes it is held to there (None: every shape)): issue 44's targets
TARGETS = [("bf16-params", "bf16", 1.0, None), ("fp8", "bf16", 1.1, ("smollm-1.7b",)),
           ("fp8-block", "bf16", 1.1, ("smollm-1.7b",)), ("compile", "hf-compile", 1.3, None)]


def target_lines(shape, records):
    """One line per target that applies to `shape`: the ratio measured and pass / miss (or why it has none)."""
    speed = {r["key"]: r.get("tokens_per_s") for r in records}
    lines = []
    for row, base, least, shapes in TARGETS:
        if shapes and shape not in shapes:
            continue
        if not speed.get(row) or not speed.get(base):
            lines.append(f"  {row} / {base} >= {least}: no ratio (a row did not run or failed)")
            continue
        ratio = speed[row] / speed[base]
        lines.append(f"  {row} / {base} >= {least}: {ratio:.2f} {'pass' if ratio >= least else 'MISS'}")
    return lines


def steady(records, key):
    values = [r[key] for r in records[SKIP_STEPS:] or records[1:] or records if r.get(key) is not None]
    return statistics.median(values) if values else None


def picotron_numbers(run_dir):
    """tokens/s, MFU of the measured and of the datasheet peak (medians after SKIP_STEPS) of a picotron run."""
    from picotron.metrics import read_metrics

    history, _ = read_metrics(run_dir)
    return dict(tokens_per_s=steady(history, "tokens_per_s"), mfu=steady(history, "mfu"),
                mfu_datasheet=steady(history, "mfu_datasheet"))


# ------------------------------------------------------------------------------------ the transformers loop
def hf_loop(args):
    """Train transformers' LlamaForCausalLM with the plain loop a learner would write; write OUT/hf.json."""
    import torch
    import transformers

    from picotron import metrics
    from picotron.model_config import ModelConfig

    device = torch.device(args.device)
    mc = ModelConfig.from_preset(args.preset)
    config = transformers.LlamaConfig(**mc.to_dict())
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    forward = torch.compile(model) if args.compile else model  # the parameters are shared: opt updates both
    b, s = args.micro_batch_size, args.seq_len
    tokens = torch.randint(0, mc.vocab_size, (args.steps, b, s + 1), device=device)
    flops = metrics.flops_per_token(mc, s) * b * s
    peak, datasheet = metrics.measured_matmul_peak(device, torch.bfloat16), metrics.datasheet_peak(device)
    records = []
    for step in range(args.steps):
        metrics.sync(device)
        t0 = time.perf_counter()
        x, y = tokens[step, :, :-1], tokens[step, :, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        metrics.sync(device)
        dt = time.perf_counter() - t0
        records.append(dict(step=step, loss=loss.item(), tokens_per_s=b * s / dt, mfu=flops / dt / peak,
                            mfu_datasheet=flops / dt / datasheet if datasheet else None))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hf.json").write_text(json.dumps(records))
    return 0


# ------------------------------------------------------------------------------------------------ the table
def run_shape(shape, st, device, out, env, only):
    import gpu_check

    records = []
    for key, label, kind, argv in rows(shape, st, device):
        if only and key not in only:
            continue
        limit = st["compile_limit_s"] if "compile" in key else st["limit_s"]
        name = f"{shape}-{key}"
        if kind == "hf":
            run_dir = out / name
            cmd = ["--hf-loop", "--out", str(run_dir), *argv]
            rec = run_hf(cmd, label, limit, env)
            if rec["ok"]:
                hf = json.loads((run_dir / "hf.json").read_text())
                rec.update(tokens_per_s=steady(hf, "tokens_per_s"), mfu=steady(hf, "mfu"),
                           mfu_datasheet=steady(hf, "mfu_datasheet"))
        else:
            rec = gpu_check.run_row(name, label, "train", argv, out, limit, env)
            rec["run"] = label
            if rec["ok"]:
                rec.update(picotron_numbers(out / name))
        records.append(dict(rec, key=key))
        print(f"  {shape} {label}: {rec['status']} ({rec['seconds'] or 0:.0f} s)", flush=True)
    base = next((r["tokens_per_s"] for r in records if r["key"] == "bf16" and r.get("tokens_per_s")), None)
    for r in records:
        r["vs_bf16"] = r["tokens_per_s"] / base if base and r.get("tokens_per_s") else None
    return records


def run_hf(argv, label, limit_s, env):
    """The "hf" row: this file's --hf-loop in a process of its own, run as gpu_check runs a training row."""
    import gpu_check

    t0 = time.perf_counter()
    output, code = gpu_check.run_process([sys.executable, __file__, *argv], limit_s, env)
    rec = dict(run=label, kind="hf", tokens_per_s=None, mfu=None, mfu_datasheet=None, ok=code == 0,
               status="pass" if code == 0 else "fail", reason="", seconds=time.perf_counter() - t0)
    if code is None:
        rec["reason"] = f"still running after its {limit_s:.0f} s limit"
    elif code != 0:
        rec["reason"] = gpu_check.reason_of(output)
    return rec


def table(shape, st, records):
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    head = ("run", "tokens/s", "MFU (measured peak)", "MFU (datasheet)", "vs bf16", "result")
    lines = [(r["run"], "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}", pct(r.get("mfu")),
              pct(r.get("mfu_datasheet")), "-" if r.get("vs_bf16") is None else f"{r['vs_bf16']:.2f}",
              r["status"] + (f": {r['reason']}" if r.get("reason") and not r["ok"] else "")) for r in records]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head[:-1])]
    fmt = lambda cells: " | ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))) + " | " + cells[-1]
    title = f"{shape}, s = {st['seq_len']}, micro-batch {st['micro_batch_size']}, {st['steps']} steps"
    return "\n".join([title, fmt(head), "-+-".join("-" * w for w in widths) + "-+-" + "-" * 6]
                     + [fmt(line) for line in lines])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "runs" / "mfu_table"), help="folder for the runs and mfu_table.json")
    p.add_argument("--cpu-smoke", action="store_true", help="the rows on the CPU with the tiny preset")
    p.add_argument("--shapes", help="comma-separated presets (default smollm-360m,smollm-1.7b)")
    p.add_argument("--only", default="", help="comma-separated subset of: bf16, hf, hf-compile, compile, triton, "
                                              "flash, bf16-params, fp8, fp8-block")
    p.add_argument("--steps", type=int)
    p.add_argument("--hf-loop", action="store_true", help=argparse.SUPPRESS)  # the child process of the "hf" row
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--micro-batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # the hf-compile row's child
    args, rest = p.parse_known_args(argv)
    if args.hf_loop:
        return hf_loop(args)
    if rest:
        p.error(f"unrecognised arguments: {' '.join(rest)}")

    import torch

    import gpu_check

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("mfu_table: torch sees no CUDA GPU here, so there is nothing to measure (--cpu-smoke runs the rows on "
              "the CPU with the tiny preset).")
        return 0
    st = dict(GPU if cuda else SMOKE)
    if args.shapes:
        st["shapes"] = tuple(s.strip() for s in args.shapes.split(",") if s.strip())
    if args.steps:
        st["steps"] = args.steps
    only = {k.strip() for k in args.only.split(",") if k.strip()}
    known = {r[0] for r in rows("tiny", st, "cpu")}
    if only - known:
        p.error(f"--only {','.join(sorted(only - known))}: pick from {', '.join(sorted(known))}")
    device = "cuda" if cuda else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = gpu_check.child_env(cuda)
    print(f"mfu_table on {gpu_check.describe_device(cuda)}: shapes {', '.join(st['shapes'])}", flush=True)
    t0, result = time.perf_counter(), dict(device=gpu_check.describe_device(cuda), cuda=cuda, settings=st, shapes={})
    texts = []
    for shape in st["shapes"]:
        records = run_shape(shape, st, device, out, env, only)
        texts.append("\n".join([table(shape, st, records), "targets:", *target_lines(shape, records)]))
        print(texts[-1], flush=True)
        result["shapes"][shape] = records
    result.update(seconds=time.perf_counter() - t0, table="\n\n".join(texts))
    (out / "mfu_table.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"written: {out / 'mfu_table.json'} ({result['seconds']:.0f} s)")
    return 0 if all(r["status"] != "fail" for rs in result["shapes"].values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
