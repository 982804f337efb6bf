"""`python -m picotron.plan` accepts what it prints: every layout of a table row, given back to `--layout` verbatim,
is accepted and evaluates to the same row (memory, step time, tokens/s, MFU); no table shows `nan`; a model given by
overrides is named as such; the memory budget keeps a default headroom (plan.HEADROOM), shown in the header."""
import dataclasses
import re

import pytest

from picotron import plan, planner
from picotron.model import ModelConfig
from picotron.planner import Layout

H100 = plan.GPUS["h100-80gb"].memory / 2**30

JOBS = {  # (the job's flags, what its top rows must include)
    "llama3-8b on 64": (["--preset", "llama3-8b", "--gpus", "64", "--seq-len", "8192", "--global-batch-tokens", "4M"],
                        None),
    "llama3-70b on 64, interleaved": (["--preset", "llama3-70b", "--gpus", "64", "--seq-len", "8192",
                                       "--global-batch-tokens", "1M"], "interleaved"),
    "overrides, fp32 gradients": (["--hidden-size", "2048", "--num-hidden-layers", "16", "--num-attention-heads", "16",
                                   "--num-key-value-heads", "8", "--gpus", "16", "--seq-len", "4096",
                                   "--global-batch-tokens", "1M", "--recipe", "mixed-fp32-grads"], None),
    "MoE on A100 40GB, fp32 gradients": (["--preset", "smollm-1.7b", "--experts", "16", "--top-k", "2", "--gpus", "32",
                                          "--gpu", "a100-40gb", "--seq-len", "2048", "--global-batch-tokens", "512K",
                                          "--recipe", "mixed-fp32-grads", "--headroom", "0.25"], "recompute-selective"),
}


def _run(capsys, argv):
    code = plan.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _table(out):
    """The rows under the table's header: [(layout text, the rest of the row)]."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layout ") and "GiB/GPU" in line) + 1
    rows = []
    for line in lines[start:]:
        if not line or line.startswith(("rejected", "*", "predicted", " ")):
            break
        text, rest = line.split(" ", 1)
        rows.append((text, rest.strip()))
    return rows


@pytest.mark.parametrize("job", list(JOBS))
def test_every_printed_layout_is_accepted_by_layout_and_evaluates_the_same(capsys, job):
    argv, wanted = JOBS[job]
    code, out, err = _run(capsys, argv + ["--top", "8"])
    assert code == 0, err
    rows = _table(out)
    assert len(rows) == 8, out
    if wanted:
        assert any(wanted in text for text, _ in rows), out
    for text, rest in rows:
        code, again, err = _run(capsys, argv + ["--layout", text])
        assert code == 0, f"--layout {text}: {err or again}"
        assert f"{text}: fits" in again, again
        assert _table(again) == [(text, rest)], f"--layout {text} evaluates differently:\n{out}\n{again}"


def test_a_searched_layout_reads_back_as_itself():
    """Every layout a search ranks prints as text that Layout.parse turns back into the same layout."""
    mc = ModelConfig.from_preset("llama3-70b")
    result = plan.search(mc, 64, plan.usable(plan.GPUS["h100-80gb"]), 8192, 128)
    assert any(lay.pp_schedule == "interleaved" and lay.pp > 1 for lay, _, _ in result.ranked)
    moe = ModelConfig.from_preset("smollm-135m", num_local_experts=8, num_experts_per_tok=2)
    experts = plan.search(moe, 16, plan.usable(plan.GPUS["h100-80gb"]), 2048, 128)
    assert any(lay.ep > 1 for lay, _, _ in experts.ranked)
    for lay, _, _ in result.ranked + experts.ranked:
        assert Layout.parse(str(lay)) == lay, str(lay)
    for lay, _ in result.rejected + experts.rejected:  # printed without ga when no whole number makes the batch
        assert Layout.parse(str(lay)) == (lay if lay.grad_acc else dataclasses.replace(lay, grad_acc=1)), str(lay)
    assert Layout.parse("pp4,interleaved-v3") == Layout.parse("pp4,interleaved,v3") == \
        Layout(pp=4, pp_schedule="interleaved", pp_chunks=3)
    for bad in ("ga0", "mbs0", "dp0", "v0", "zero4", "interleaved-v0", "1f1b-v2"):
        with pytest.raises(ValueError, match=f"'{bad}'"):
            Layout.parse(f"pp2,{bad}")


def test_a_rejected_example_given_to_layout_is_refused_for_the_same_reason(capsys):
    argv = ["--preset", "llama3-8b", "--gpus", "1024", "--seq-len", "8192", "--global-batch-tokens", "4M"]
    code, out, _ = _run(capsys, argv)
    examples = re.findall(r"^ +\d+ x  (\S+): (.*)$", out, re.M)
    assert len(examples) >= 3, out
    for text, why in examples:
        code, again, err = _run(capsys, argv + ["--layout", text])
        assert code == 1, f"--layout {text}: {err or again}"
        assert f"{text}: does not run: {why}" in again, again


NO_NAN = [
    ["--layout", "tp3,dp8,mbs1", "--gpus", "24"],  # tp does not divide the heads
    ["--layout", "pp64", "--gpus", "64"],  # more stages than layers
    ["--layout", "dp1024,mbs1", "--gpus", "1024", "--seq-len", "8192", "--global-batch-tokens", "4M"],  # the batch
    ["--layout", "dp8,mbs1", "--seq-len", "8192", "--global-batch-tokens", "512K"],  # does not fit
    ["--layout", "dp8,zero3,mbs1"],  # fits
    ["--preset", "llama3-70b", "--gpus", "8"],  # nothing fits
    ["--gpus", "64", "--max-tp", "16", "--top", "40"],
]


@pytest.mark.parametrize("argv", NO_NAN, ids=lambda a: " ".join(a))
def test_no_table_shows_nan(capsys, argv):
    code, out, err = _run(capsys, argv)
    assert code in (0, 1), err
    assert not re.search(r"\b(nan|inf)\b", out, re.I), out
    if "--layout" in argv:
        (text, rest), = _table(out)
        if code == 1 and "does not fit" not in out:
            assert rest.startswith("—") and "refused" in rest, out  # a dash and the refusal, not numbers


def test_a_model_given_by_overrides_is_named_after_what_it_is(capsys):
    _, out, _ = _run(capsys, ["--hidden-size", "1024", "--num-hidden-layers", "8", "--gpus", "8", "--seq-len", "1024",
                              "--global-batch-tokens", "64K", "--top", "1"])
    assert out.startswith("llama3-8b with hidden_size=1024, num_hidden_layers=8 ("), out
    _, out, _ = _run(capsys, ["--preset", "smollm-135m", "--experts", "4", "--gpus", "8", "--seq-len", "1024",
                              "--global-batch-tokens", "64K", "--top", "1"])
    assert out.startswith("smollm-135m with num_local_experts=4 ("), out
    # an override equal to the preset's own value changes nothing: the preset's name
    layers = ModelConfig.from_preset("smollm-135m").num_hidden_layers
    _, out, _ = _run(capsys, ["--preset", "smollm-135m", "--num-hidden-layers", str(layers), "--gpus", "8",
                              "--seq-len", "1024", "--global-batch-tokens", "64K", "--top", "1"])
    assert out.startswith("smollm-135m (0.13 B parameters)"), out


@pytest.mark.heavy  # two 70B searches on 256 GPUs (25 s): the heavy tier
def test_the_default_headroom_keeps_ten_percent_free_and_says_so(capsys):
    assert plan.HEADROOM == 0.1
    job = ["--preset", "llama3-70b", "--gpus", "256", "--seq-len", "8192", "--global-batch-tokens", "4M", "--top", "5"]
    code, out, _ = _run(capsys, job)
    assert code == 0
    usable = 0.9 * H100
    assert f"{usable:.1f} GiB usable: 10% of the {H100:.1f} GiB kept free" in out.splitlines()[0], out
    assert all(float(rest.split()[0]) <= usable for _, rest in _table(out)), out
    # --headroom 0: the whole card, which the best layouts then fill to the last GiB
    code, out, _ = _run(capsys, job + ["--headroom", "0"])
    assert code == 0 and f"({H100:.1f} GiB, no headroom, " in out.splitlines()[0], out
    assert max(float(rest.split()[0]) for _, rest in _table(out)) > usable, out
    # the same for one layout: what fits the whole card is refused with the default headroom
    lay = "dp8,zero1,mbs1,ga8"
    need = planner.memory_per_gpu(ModelConfig.from_preset("llama3-8b"), Layout.parse(lay), 8192, "bf16", "mixed")
    assert usable * 2**30 < need["total"] <= H100 * 2**30
    one = ["--preset", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch-tokens", "512K", "--layout", lay]
    assert _run(capsys, one + ["--headroom", "0"])[0] == 0
    code, out, _ = _run(capsys, one)
    assert code == 1 and f"does not fit: {need['total'] / 2**30:.1f} GiB > {usable:.1f} GiB" in out, out
    # documented where a user looks: --help and the module docstring
    with pytest.raises(SystemExit):
        plan.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--headroom" in help_text and "default 0.1" in help_text and "--headroom 0" in help_text
    assert "headroom" in plan.hardware.__doc__.lower() and "HEADROOM" in plan.hardware.__doc__



def test_when_no_layout_fits_it_names_the_least_memory_and_the_fewest_gpus(capsys):
    """Issue 41: a job too big for its GPUs names the least memory per GPU any layout needs (the layout's own figure,
    the minimum of the search), the fewest GPUs at which one fits (a layout the command then accepts, and none at
    the count before), and lists only the reasons that keep out a layout needing less: no ZeRO-with-DualPipe noise."""
    argv = ["--preset", "llama3-70b", "--gpus", "8"]
    code, out, _ = _run(capsys, argv)
    assert code == 1 and "(no layout fits)" in out, out
    least = re.search(r"^least memory per GPU of any layout: ([\d.]+) GiB > ([\d.]+) GiB usable, with (\S+) ", out, re.M)
    assert least, out
    mc, hw = ModelConfig.from_preset("llama3-70b"), plan.usable(plan.GPUS["h100-80gb"])
    named = Layout.parse(least[3])
    need = planner.memory_per_gpu(mc, named, 4096, "bf16", "mixed")["total"]
    searched = plan.search(mc, 8, hw, 4096, 256)
    assert need == plan.least_memory(searched)[1]["total"] and least[1] == f"{need / 2**30:.1f}"
    fewest = re.search(r"^fewest GPUs above 8 at which a layout fits: (\d+) x H100 80GB SXM, e.g. (\S+): ", out, re.M)
    assert fewest, out
    n, example = int(fewest[1]), fewest[2]
    assert _run(capsys, ["--preset", "llama3-70b", "--gpus", str(n), "--layout", example])[0] == 0  # fits there
    assert n == 16 and not searched.ranked  # 8, the count before 16, fits nothing
    listed = out[out.index("rejected, by reason"):]
    assert "dualpipe" not in listed and "is not supported" not in listed and "dp=1" not in listed, listed
    assert f"x  {least[3]}: does not fit: {least[1]} GiB" in listed, listed


# The command-line flags of the published runs whose hardware is in plan.GPUS (BLOOM's Jean Zay network is not), judged
# under the default headroom, as --published judges them.
PUBLISHED_ARGV = {
    "Llama 3 405B": ["--preset", "llama3-405b", "--gpus", "16384", "--seq-len", "8192", "--global-batch-tokens", "16M",
                     "--recipe", "mixed-fp32-grads"],
    "Megatron GPT 145.6B": ["--vocab-size", "51200", "--hidden-size", "12288", "--intermediate-size", "32768",
                            "--num-hidden-layers", "80", "--num-attention-heads", "96", "--num-key-value-heads", "96",
                            "--max-position-embeddings", "2048", "--tie-word-embeddings", "--gpu", "a100-80gb",
                            "--gpus", "1536", "--seq-len", "2048", "--global-batch-tokens", str(2304 * 2048)],
}


def test_every_published_layout_reads_back_and_evaluates_as_printed(capsys):
    """The layouts --published prints (its lines, as `print_published` writes them) parse back to the runs' layouts;
    given to --layout with the run's job, one evaluates to the printed memory (and, for a run counted without
    recomputation, the printed TFLOP/s); if picotron's trainer refuses it, with the trainer's sentence (parallelize's rules:
    e.g. ZeRO-2 with a pipeline until the trainer runs it) and still shows the model's figures."""
    lines = []
    plan.print_published(rank=False, out=lines.append)
    printed = dict(re.findall(r"^(.+?): [\d,]+ x .+?, (\S+): ", "\n".join(lines), re.M))
    assert set(printed) == {run.name for run in plan.PUBLISHED}
    for run in plan.PUBLISHED:
        assert Layout.parse(printed[run.name]) == run.layout, run.name
    for name, argv in PUBLISHED_ARGV.items():
        run = next(r for r in plan.PUBLISHED if r.name == name)
        line = next(x for x in lines if x.startswith(name + ":"))
        code, out, err = _run(capsys, argv + ["--layout", printed[name]])
        refused = plan.trainer_problem(ModelConfig(**run.model), run.layout, run.seq_len)
        if refused:  # the trainer's sentence, then the model's figures all the same
            assert code == 1 and f"{printed[name]}: does not run: {refused}" in out, out + err
            assert "the model's figures for it all the same (as another trainer would run it): fits" in out, out
        else:
            assert code == 0 and f"{printed[name]}: fits" in out, out + err
        (text, rest), = _table(out)
        assert text == printed[name] and f"fits, {rest.split()[0]} GiB per GPU" in line, (out, line)
        assert "GiB under the 71.7 GiB usable (10% kept free)" in line or "GiB under the 71.3 GiB usable" in line, line
        if not run.counts_recompute:
            tflops = re.search(r"predicted (\d+) TFLOP/s per GPU vs", line).group(1)
            assert f", {tflops} TFLOP/s per GPU of model FLOPs" in out, (out, line)


def test_dualpipe_and_ulysses_layouts_read_back_and_evaluate(capsys):
    """The new names print and parse like the others; --layout evaluates them (refused by picotron's trainer until it
    has them, with its sentence, and the model's figures all the same); a search that offers them (as it does once the
    trainer has them, picotron.config) ranks layouts with them, and each reads back as itself."""
    mc = ModelConfig.from_preset("llama3-8b")
    job = ["--preset", "llama3-8b", "--gpus", "64", "--seq-len", "8192", "--global-batch-tokens", "4M"]
    for text in ("dp4,tp4,pp4,dualpipe,mbs1,ga128", "dp4,tp4,cp4,ulysses,mbs1,ga128"):
        code, out, err = _run(capsys, job + ["--layout", text])
        refused = plan.trainer_problem(mc, Layout.parse(text), 8192)
        assert code == (1 if refused else 0) and (refused or "fits") in out, out + err
        (shown, rest), = _table(out)
        want = planner.memory_per_gpu(mc, Layout.parse(text), 8192, "bf16", "mixed")["total"] / 2**30
        assert shown == text and rest.split()[0] == f"{want:.1f}", out
    for text in ("dp4,pp4,dualpipe,mbs1,ga16", "dp2,cp4,ulysses,sp,tp2,mbs1,ga8", "dp8,pp2,zero3,1f1b,mbs1,ga8"):
        lay = Layout.parse(text)
        assert Layout.parse(str(lay)) == lay
    space = {"schedules": (("1f1b", 1), ("dualpipe", 1)), "cp_impls": ("ring", "ulysses"), "recompute": ("none",),
             "micro_batches": (1,), "zero": (0, 1)}
    found = plan.search(mc, 64, plan.usable(plan.GPUS["h100-80gb"]), 8192, 128, space=space, rules=False)
    assert any(lay.pp_schedule == "dualpipe" and lay.pp > 1 for lay, _, _ in found.ranked)
    assert any(lay.cp_impl == "ulysses" and lay.cp > 1 for lay, _, _ in found.ranked)
    for lay, _, _ in found.ranked:
        assert Layout.parse(str(lay)) == lay, str(lay)
