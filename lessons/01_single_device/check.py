"""Checker for lesson 01's exercises: runs your functions on several inputs against the reference and
against measurement, and says precisely what is off.

    ./run.sh python lessons/01_single_device/check.py [name ...]          # your lessons/01_single_device/exercise.py
    ./run.sh python lessons/01_single_device/check.py --solutions         # the reference solutions (must pass)
    ./run.sh python lessons/01_single_device/check.py --module my.py      # any file defining the same functions
From the lesson's notebook: `import check as checker; checker.check()` (returns True when everything passes).
Exit status 0 when every check passes, 1 otherwise.

The puzzle, plan_step, is checked twice: by the planner (the global batch unchanged, `peak_bound` within the
budget) and by a short real run on the CPU (the allocator's peak within the budget, tokens/s beside the
reference choice's). Which choice is fastest is decided by the rule the exercise states, not by the timing.
"""
import dataclasses
import itertools
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # lessons/: _checker, which puts the repository root on sys.path too
sys.path.insert(0, str(HERE))  # this lesson's experiment.py (the allocator measurement, peak_bound)

import torch  # noqa: E402
from _checker import entry_points, load  # noqa: E402

import experiment as lesson  # noqa: E402
from picotron import metrics, planner  # noqa: E402
from picotron.model import Llama, ModelConfig  # noqa: E402

LEARNER = HERE / "exercise.py"
SOLUTIONS = HERE / "solution.py"
MiB = 2**20


def explain(diff, mistakes):
    """The smallest combination of known mistakes (name -> how much it changes the answer) that accounts
    for `diff` exactly, as a hint; '' if none does."""
    for n in range(1, 4):
        for combo in itertools.combinations(mistakes.items(), n):
            if sum(delta for _, delta in combo) == diff:
                return " — " + " Also: ".join(name for name, _ in combo)
    return ""


def call(report, what, fn, *args):
    """Run the learner's function; turn an exception into a one-line failure (the traceback's last line)."""
    try:
        return True, fn(*args)
    except NotImplementedError as e:
        report.fail(what, f"NotImplementedError: {e or 'not written yet'}")
    except Exception as e:  # noqa: BLE001 - any bug in the learner's code is a failed check, not a crash
        line = traceback.extract_tb(e.__traceback__)[-1]
        report.fail(what, f"{type(e).__name__}: {e} (line {line.lineno}: {line.line})")
    return False, None


# ------------------------------------------------------------------------------------- exercises
def configs():
    tiny = ModelConfig.from_preset("tiny")
    return {"tiny": tiny, "tiny-tied": dataclasses.replace(tiny, tie_word_embeddings=True),
            "tiny-mha": dataclasses.replace(tiny, num_key_value_heads=tiny.num_attention_heads),
            **{name: ModelConfig.from_preset(name) for name in ("smollm-135m", "smollm-1.7b", "llama3-8b")}}


def check_count_parameters(mod, ref, report):
    for name, c in configs().items():
        what = f"count_parameters({name})"
        done, got = call(report, what, mod.count_parameters, c)
        if not done:
            continue
        expected = ref.count_parameters(c)
        if got == expected:
            report.ok(what, f" = {expected:,}")
            continue
        h, v, L, i = c.hidden_size, c.vocab_size, c.num_hidden_layers, c.intermediate_size
        kv = c.num_key_value_heads * c.head_dim
        mistakes = {
            "did you count lm_head although tie_word_embeddings=True?" if c.tie_word_embeddings else
            "did you forget lm_head (tie_word_embeddings=False: it is a second v×h matrix)?":
                v * h if c.tie_word_embeddings else -v * h,
            "k_proj and v_proj map h to num_key_value_heads·head_dim (grouped-query attention), not to h": 2 * L * h * (h - kv),
            "SwiGLU has three matrices (gate_proj, up_proj, down_proj), not two": -L * h * i,
            "did you forget the two RMSNorm weights per layer?": -2 * L * h,
            "did you forget the final norm's weight?": -h,
            "did you forget the embedding?": -v * h,
            "did you add biases? The Linear layers have none": L * (2 * h + 2 * kv + 2 * i + h),
        }
        hint = explain(got - expected, {k: d for k, d in mistakes.items() if d})
        report.fail(what, f"got {got:,}, expected {expected:,}{hint}")


def check_model_state_bytes(mod, ref, report):
    n = 1_000_000
    for dtype, opt in itertools.product(("fp32", "bf16"), ("adamw", "sgd")):
        what = f"model_state_bytes({n:,}, {dtype!r}, {opt!r})"
        done, got = call(report, what, mod.model_state_bytes, n, dtype, opt)
        if not done:
            continue
        expected = ref.model_state_bytes(n, dtype, opt)
        if not isinstance(got, dict) or set(got) != set(expected):
            report.fail(what, f"return a dict with keys {sorted(expected)}, got {got!r}")
            continue
        wrong = {k: got[k] for k in expected if got[k] != expected[k]}
        if not wrong:
            report.ok(what, f" = {expected} ({sum(expected.values()) // n} bytes/param)")
            continue
        hints = []
        if dtype == "bf16" and got["optimizer"] == expected["optimizer"] - 4 * n:
            hints.append("the optimizer also keeps an fp32 master copy of the weights (4 bytes/param)")
        if opt == "sgd" and got["optimizer"] - expected["optimizer"] == 8 * n:
            hints.append("plain SGD keeps no moments")
        if dtype == "bf16" and got["params"] == 4 * n:
            hints.append("bf16 parameters take 2 bytes each")
        detail = ", ".join(f"{k}: got {got[k]:,}, expected {expected[k]:,}" for k in wrong)
        report.fail(what, detail + (" — " + "; ".join(hints) if hints else ""))


def measured_layer_bytes(c, s, b):
    """What one decoder layer saves, MEASURED: the saved-tensor count of a 2-layer model minus a 1-layer
    one (everything outside the layers cancels), fp32, random weights."""
    counts = []
    for layers in (1, 2):
        torch.manual_seed(0)
        model = Llama(dataclasses.replace(c, num_hidden_layers=layers))
        counter = metrics.ActivationCounter(model)
        with counter:
            model(torch.randint(0, c.vocab_size, (b, s))).sum()
        counts.append(counter.bytes)
    return counts[1] - counts[0]


def check_activation_bytes_per_layer(mod, ref, report):
    tiny = ModelConfig.from_preset("tiny")
    cases = [("tiny", tiny, 64, 2), ("tiny", dataclasses.replace(tiny, attn_impl="eager"), 64, 2),
             ("tiny-mha", dataclasses.replace(tiny, num_key_value_heads=8), 32, 3),
             ("smollm-135m", ModelConfig.from_preset("smollm-135m"), 2048, 1)]
    for name, c, s, b in cases:
        what = f"activation_bytes_per_layer({name}, attn_impl={c.attn_impl}, s={s}, b={b})"
        done, got = call(report, what, mod.activation_bytes_per_layer, c, s, b)
        if not done:
            continue
        expected = ref.activation_bytes_per_layer(c, s, b)
        measured = measured_layer_bytes(c, s, b) if c.vocab_size <= 256 else None
        source = f"measured with saved-tensor hooks: {measured:,}" if measured is not None else "formula"
        if got == expected:
            report.ok(what, f" = {expected:,} ({source})")
            continue
        h, i, a = c.hidden_size, c.intermediate_size, c.num_attention_heads
        kv = c.num_key_value_heads * c.head_dim
        sb, sbh = s * b, s * b * h
        mistakes = {
            "sdpa also saves its logsumexp, 4·a·s·b bytes": -4 * a * sb if c.attn_impl == "sdpa" else 0,
            "K and V have num_key_value_heads·head_dim features, not h (GQA)": 8 * sb * (h - kv) if c.attn_impl == "sdpa" else 0,
            "q_proj, k_proj and v_proj share ONE saved input (count it once)": 8 * sbh,
            "gate_proj and up_proj share ONE saved input (count it once)": 4 * sbh,
            "each RMSNorm also saves its 1/rms (4·s·b bytes)": -8 * sb,
            "each RMSNorm saves its input AND the normalised x": -8 * sbh,
            "o_proj's input is the sdpa output itself (already saved)": 4 * sbh if c.attn_impl == "sdpa" else 0,
            "the MLP saves four h_ff-wide tensors (gate, silu(gate), up, their product)": -4 * sb * i,
            "eager attention keeps the fp32 softmax output, 4·a·s²·b bytes": -4 * a * s * s * b if c.attn_impl == "eager" else 0,
            "eager attention keeps the causal mask (s² bools)": -s * s if c.attn_impl == "eager" else 0,
            "leave out the RoPE cos/sin tables (shared by all layers)": 2 * 4 * s * c.head_dim,
        }
        if got * 2 == expected:
            hint = " — fp32 activations take 4 bytes per element, not 2"
        elif got == 34 * sbh + 5 * a * s * s * b or got == 34 * sbh:
            hint = " — that is Korthikanti's GPT-3 formula; count the tensors OUR Llama saves (lesson section 2)"
        else:
            hint = explain(got - expected, {k: d for k, d in mistakes.items() if d}) or \
                f" — off by {got - expected:+,} bytes; compare term by term with the saved-tensor table"
        report.fail(what, f"got {got:,}, expected {expected:,} ({source}){hint}")


def check_accumulate_gradients(mod, ref, report):
    import torch.nn.functional as F

    c = dataclasses.replace(ModelConfig.from_preset("tiny"), num_hidden_layers=2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g)

    def fresh():
        with torch.device("meta"):
            model = Llama(c)
        return model.to_empty(device="cpu").init_weights(0)

    big = fresh()
    loss = F.cross_entropy(big(x).view(-1, 256), y.reshape(-1))
    loss.backward()
    ref_grads = {n: p.grad for n, p in big.named_parameters()}
    for k in (1, 2, 4, 8):
        what = f"accumulate_gradients(tiny, batch 8, k={k})"
        model = fresh()
        done, got_loss = call(report, what, mod.accumulate_gradients, model, x, y, k)
        if not done:
            continue
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        if missing:
            report.fail(what, f"p.grad is None for {missing[0]} (and {len(missing) - 1} more): did you call backward()?")
            continue
        diff = max((p.grad - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())
        ratio = sum((p.grad * ref_grads[n]).sum().item() for n, p in model.named_parameters()) / \
            sum((ref_grads[n] ** 2).sum().item() for n, _ in model.named_parameters())
        if diff > 1e-5:
            hint = ""
            if abs(ratio - k) < 1e-3 * k and k > 1:
                hint = f" — the gradients are {ratio:.2f}× the reference: divide each micro-batch's loss by k"
            elif k > 1:
                hint = " — did you zero the gradients between micro-batches, or split the batch unevenly?"
            report.fail(what, f"max |grad - full-batch grad| = {diff:.2e} (tolerance 1e-5){hint}")
            continue
        if not isinstance(got_loss, (float, int)) and not (torch.is_tensor(got_loss) and got_loss.numel() == 1):
            report.fail(what, f"return the mean loss as a float, got {type(got_loss).__name__}")
            continue
        if abs(float(got_loss) - loss.item()) > 1e-5:
            hint = " — sum the micro-batches' loss / k" if abs(float(got_loss) - k * loss.item()) < 1e-4 else ""
            report.fail(what, f"gradients right, but returned loss {float(got_loss):.6f}, expected {loss.item():.6f}{hint}")
            continue
        report.ok(what, f": max |grad - full-batch grad| = {diff:.1e}, loss {float(got_loss):.6f}")


# ------------------------------------------------------------------------------------------- the puzzle
RECOMPUTE = ("none", "selective", "full")  # from the least work repeated to the most
# (name, settings of the tiny preset, seq_len, global batch in sequences, budget in MiB)
PUZZLES = [
    ("roomy", {}, 256, 16, 256),
    ("tight", {}, 256, 16, 100),
    ("tighter", {}, 256, 16, 24),
    ("long sequence", dict(attn_impl="eager"), 512, 8, 80),
]


def model_name(settings):
    return "tiny" + (" with eager attention" if settings.get("attn_impl") == "eager" else "")


def describe(choice):
    return f"micro-batch {choice['micro_batch_size']} x {choice['grad_acc']}, recompute {choice['recompute']}"


def malformed(got):
    keys = {"micro_batch_size", "grad_acc", "recompute"}
    if not isinstance(got, dict) or set(got) != keys:
        return f"return a dict with exactly the keys {sorted(keys)}, got {got!r}"
    if not all(isinstance(got[k], int) and got[k] >= 1 for k in ("micro_batch_size", "grad_acc")):
        return f"micro_batch_size and grad_acc must be positive ints, got {got!r}"
    if got["recompute"] not in RECOMPUTE:
        return f"recompute must be one of {RECOMPUTE}, got {got['recompute']!r}"
    return ""


def over_budget(mc, s, b, recompute, budget):
    """Why `peak_bound` exceeds the budget, and what to try."""
    est = planner.memory_estimate(mc, s, b, "fp32", recompute)
    bound = lesson.peak_bound(mc, s, b, "fp32", recompute)
    states, acts, working = est["total"] - est["activations"], est["activations"], bound - est["total"]
    why = (f"over budget by {(bound - budget) / MiB:.1f} MiB: model states {states / MiB:.1f} + saved activations "
           f"{acts / MiB:.1f} + backward working set {working / MiB:.1f} = {bound / MiB:.1f} MiB (peak_bound) > "
           f"{budget / MiB:g} MiB")
    if states > budget:
        return why + (" — the model states alone exceed the budget: no micro-batch size or recomputation helps "
                      "(lesson 04 shards them over devices)")
    if b > 1:
        share = "dominate" if acts + working > states else "are the part that shrinks"
        return why + (f" — the activations of micro-batch {b} {share}; try a smaller micro-batch with more "
                      f"accumulation steps (the activations shrink with it, the global batch stays)")
    if recompute != "full":
        return why + (" — micro-batch 1 is as small as it gets: keep fewer activations with recomputation "
                      "(selective drops the attention core's, full all but each layer's input)")
    return why + " — even micro-batch 1 with full recomputation does not fit"


def slower_than(got, expected):
    """Why `got` is slower than `expected` by the exercise's rule (the least recomputation, then the fewest
    micro-batches); '' when it is not."""
    mine, theirs = RECOMPUTE.index(got["recompute"]), RECOMPUTE.index(expected["recompute"])
    if mine > theirs:
        return (f"it recomputes ({got['recompute']}) although {describe(expected)} fits: recomputation repeats forward "
                f"work during the backward (full: every layer's forward once more, about +33% FLOPs; selective: the "
                f"attention core only)")
    if mine == theirs and got["grad_acc"] > expected["grad_acc"]:
        return (f"{got['grad_acc']} micro-batches of {got['micro_batch_size']} where {expected['grad_acc']} of "
                f"{expected['micro_batch_size']} fit: every micro-batch is one more pass over all the weights with "
                f"smaller matmuls (on a GPU small micro-batches leave the tensor cores idle)")
    return ""


def real_step(settings, s, choice):
    """A short real run of the choice on the CPU: the allocator's peak over the second (steady) step, and
    tokens/s of the fastest of two more steps."""
    cfg = lesson.make_cfg("tiny", seq_len=s, **settings, **choice)
    r = lesson.step_memory(cfg, torch.device("cpu"), steps=2, timed_steps=2)
    return dict(peak=r["steps"][-1]["peak"], op=r["steps"][-1]["peak_op"], tokens_per_s=r["tokens_per_s"])


def check_plan_step(mod, ref, report):
    for name, settings, s, gb, budget_mib in PUZZLES:
        mc, budget = lesson.make_cfg("tiny", **settings).model_config(), budget_mib * MiB
        what = f"plan_step({name}: {model_name(settings)}, s={s}, global batch {gb}, {budget_mib} MiB)"
        done, got = call(report, what, mod.plan_step, mc, s, gb, budget)
        if not done:
            continue
        if malformed(got):
            report.fail(what, malformed(got))
            continue
        b, k, recompute = got["micro_batch_size"], got["grad_acc"], got["recompute"]
        if b * k != gb:
            report.fail(what, f"micro_batch_size x grad_acc = {b} x {k} = {b * k} sequences, but the global batch is {gb}: "
                              "gradient accumulation splits the batch, it must not change it")
            continue
        if lesson.peak_bound(mc, s, b, "fp32", recompute) > budget:
            report.fail(what, over_budget(mc, s, b, recompute, budget))
            continue
        mine = real_step(settings, s, got)
        measured = f"measured peak {mine['peak'] / MiB:.1f} of {budget_mib} MiB, {mine['tokens_per_s']:,.0f} tokens/s"
        if mine["peak"] > budget:
            report.fail(what, f"peak_bound fits, but the real step peaked at {mine['peak'] / MiB:.1f} MiB, "
                              f"{(mine['peak'] - budget) / MiB:.1f} MiB over the budget (at {mine['op']}): leave more headroom")
            continue
        expected = ref.plan_step(mc, s, gb, budget)
        why = slower_than(got, expected)
        if not why:
            same = "" if got == expected else f" (the reference: {describe(expected)})"
            report.ok(what, f": {describe(got)}{same}; {measured}")
            continue
        theirs = real_step(settings, s, expected)
        report.fail(what, f"{describe(got)} fits ({measured}) but is not the fastest choice: {why}. Measured: yours "
                          f"{mine['tokens_per_s']:,.0f}, the reference's {theirs['tokens_per_s']:,.0f} tokens/s "
                          f"(x{mine['tokens_per_s'] / theirs['tokens_per_s']:.2f}; a shared CPU's timings vary by tens of "
                          f"percent: the rule decides, not this one measurement)")


def made_trace(seed=0):
    """A trace as `--profile 2:3` writes it (picotron.trace), of two steps of two micro-batches: torch's operators
    inside the phases, metadata, a flow, the step ranges and the start marker; and its phases' ms by hand."""
    import random
    rng = random.Random(seed)
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
              {"ph": "X", "cat": "user_annotation", "name": "picotron: profile start", "pid": 1, "tid": 1, "ts": 0.0,
               "dur": 180.0}]
    want, t = {}, 1000.0
    for step in (2, 3):
        start = t
        for name in ("forward mb=0", "forward mb=1", "wait", "backward mb=0", "backward mb=1", "clip grad norm",
                     "optimizer step"):
            dur = rng.uniform(200.0, 90000.0)
            events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": t, "dur": dur})
            events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t + 1,
                           "dur": dur / 2})
            events.append({"ph": "f", "cat": "ac2g", "name": "flow", "id": len(events), "pid": 1, "tid": 1, "ts": t})
            phase = name.split(" mb=")[0]
            want[phase] = want.get(phase, 0.0) + dur / 1e3
            t += dur + 50.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"step {step}", "pid": 1, "tid": 1, "ts": start,
                       "dur": t - start})
    return {"traceEvents": events, "baseTimeNanoseconds": 1790000000000000000}, want


def check_phase_ms(mod, ref, report):
    what = "phase_ms(a --profile 2:3 trace)"
    for seed in (0, 1):
        trace, want = made_trace(seed)
        done, got = call(report, what, mod.phase_ms, trace)
        if not done:
            return
        if not isinstance(got, dict):
            report.fail(what, f"return a dict {{phase: ms}}, got {type(got).__name__}")
            return
        extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        if extra or missing:
            hints = []
            if any(k.startswith("step ") or k.startswith("picotron:") for k in extra):
                hints.append("leave out the step ranges and the start marker: they hold the phases")
            if any(" mb=" in k for k in extra):
                hints.append("a phase is the name up to its \" mb=\": every micro-batch's forward is \"forward\"")
            if any(k.startswith("aten::") or k in ("process_name", "flow") for k in extra):
                hints.append("count only complete events (ph X) of category user_annotation: aten::mm is torch's "
                             "operator inside the phase, process_name is metadata")
            report.fail(what, f"phases {sorted(got)}, expected {sorted(want)}" + (" — " + "; ".join(hints) if hints
                                                                                  else ""))
            return
        for phase, ms in want.items():
            if abs(got[phase] - ms) > 1e-6 * max(1.0, ms):
                ratio = got[phase] / ms if ms else float("inf")
                hint = (" — a trace's ts and dur are microseconds: divide by 1000" if abs(ratio - 1000) < 1e-3 else
                        " — count only user_annotation events: torch's operators inside the phase add their time"
                        if abs(ratio - 1.5) < 1e-3 else "")
                report.fail(what, f"{phase}: {got[phase]:.3f} ms, expected {ms:.3f}{hint}")
                return
    report.ok(what, f": {', '.join(f'{k} {v:.1f} ms' for k, v in want.items())}")


CHECKS = {"count_parameters": check_count_parameters, "model_state_bytes": check_model_state_bytes,
          "activation_bytes_per_layer": check_activation_bytes_per_layer,
          "accumulate_gradients": check_accumulate_gradients, "plan_step": check_plan_step, "phase_ms": check_phase_ms}


def check_one(name, path, report, timeout_s=None):  # in this process: no timeout to apply
    mod, ref = load(path, "ex01"), load(SOLUTIONS, "ex01_ref")
    if not hasattr(mod, name):
        report.fail(name, f"{Path(path).name} has no function {name}")
        return
    CHECKS[name](mod, ref, report)


check, main = entry_points("Check lesson 01's exercises (in this process).", list(CHECKS), check_one, LEARNER,
                           SOLUTIONS, None, "ex01")


if __name__ == "__main__":
    sys.exit(main())
