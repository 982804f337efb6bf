"""Config: defaults, JSON + flags layering, and one test per validation rule reading its one-sentence message."""
import json
import os
import subprocess
import sys

import pytest

from picotron import config
from picotron.config import Config, ConfigError, parse_args
from picotron.parallelize import cli, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_sentence(msg):
    """The message style every rule follows: a single line, a single sentence, ending with a full stop."""
    assert "\n" not in msg and msg.endswith(".") and ". " not in msg and ";" in msg, msg
    return msg


def error_of(world_size=1, **fields):
    with pytest.raises(ConfigError) as e:
        validate(Config(**fields), world_size)
    return one_sentence(str(e.value))


def test_defaults_are_valid_and_derived_sizes():
    cfg = Config()
    validate(cfg, 1)
    assert (cfg.preset, cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.zero, cfg.sp) == ("tiny", 1, 1, 1, 1, 1, 0, False)
    assert cfg.world_size == 1 and cfg.global_batch_size == 16 and cfg.tokens_per_step == 16 * 128
    assert Config(dp=2, tp=2, pp=2, cp=2, grad_acc=3, micro_batch_size=4).world_size == 16
    assert Config(dp=2, grad_acc=3, micro_batch_size=4).global_batch_size == 24


def test_model_config_applies_overrides():
    mc = Config(hidden_size=64, num_hidden_layers=2).model_config()
    assert (mc.hidden_size, mc.num_hidden_layers, mc.num_attention_heads, mc.vocab_size) == (64, 2, 8, 256)
    assert Config(preset="smollm-135m").model_config().num_attention_heads == 9


# ------------------------------------------------------------------------------------------------ the rules
def test_world_size_must_equal_product_of_degrees():
    msg = error_of(world_size=2)
    assert "world size 2" in msg and "dp*pp*cp*tp" in msg and "= 1" in msg and "torchrun" in msg
    msg = error_of(world_size=1, dp=2, tp=2)
    assert "world size 1" in msg and "= 4" in msg and "--nproc_per_node 4" in msg
    validate(Config(dp=2, tp=2), 4)  # the matching world size is fine


def test_the_world_size_is_the_launchers():
    """validate reads no environment: the launcher's numbers come in as arguments (train.read_command passes
    launch.place's); without them a process is on its own."""
    with pytest.raises(ConfigError, match="world size 3"):
        validate(Config(), 3)
    validate(Config())


@pytest.mark.parametrize("tp, name, value, fields", [
    (3, "num_attention_heads", 8, {}),
    (4, "num_key_value_heads", 6, {"hidden_size": 192, "num_attention_heads": 12, "num_key_value_heads": 6}),
    (2, "intermediate_size", 385, {"intermediate_size": 385}),
    (2, "vocab_size", 257, {"vocab_size": 257}),
])
def test_tp_must_divide_heads_kv_heads_mlp_and_vocab(tp, name, value, fields):
    msg = error_of(tp=tp, **fields)
    assert msg.startswith(f"tp={tp} does not divide {name}={value}; pick tp in {{1")


def test_tp_needs_a_whole_kv_head_per_rank():
    msg = error_of(tp=8)  # tiny: 8 query heads but 4 KV heads
    assert msg == ("tp=8 is more than num_key_value_heads=4 (every tensor-parallel rank needs at least one whole KV "
                   "head, and KV heads are not replicated); pick tp in {1, 2, 4} or a model with at least 8 KV heads.")


def test_tp_message_matches_spec_example():
    assert error_of(tp=3) == "tp=3 does not divide num_attention_heads=8; pick tp in {1, 2, 4}."


def test_pp_needs_a_layer_per_stage():
    msg = error_of(world_size=5, pp=5)
    assert msg.startswith("pp=5 with 1 chunk per rank needs 5 stages of at least one layer each but the model has "
                          "num_hidden_layers=4; pick pp <= 4")
    validate(Config(pp=3), 3)  # stages may hold different numbers of layers: the split balances their cost


def test_cp_needs_seq_len_divisible_by_2cp():
    msg = error_of(cp=3)
    assert "cp=3" in msg and "seq_len=128" in msg and "2*cp=6" in msg and "pick cp in {1, 2, 4" in msg
    assert msg.endswith("; pick cp in {1, 2, 4, 8, 16, 32, 64}, or pass --seq-len 126 (a multiple of 6).")  # issue 41
    assert error_of(cp=2, seq_len=130).endswith("pass --seq-len 128 (a multiple of 4).")  # 130 % 4 != 0


def test_sp_needs_tp():
    assert error_of(sp=True) == ("--sp with tp=1 does nothing (sequence parallelism splits what tensor parallelism "
                                 "leaves replicated over the tp ranks); add --tp 2 or more, or drop --sp.")


def test_sp_needs_local_sequence_divisible_by_tp():
    msg = error_of(tp=4, sp=True, seq_len=130)
    assert "sp with tp=4" in msg and "seq_len/cp=130" in msg and "multiple of 4" in msg


def test_ep_must_divide_dp():
    msg = error_of(world_size=2, dp=2, ep=3, preset="tiny-moe")
    assert "ep=3 does not divide dp=2 and the 4 experts" in msg and "pick ep in {1, 2}" in msg


def test_seq_len_within_max_positions():
    msg = error_of(seq_len=2048)
    assert "seq_len=2048 exceeds max_position_embeddings=1024" in msg and "--seq-len 1024" in msg


@pytest.mark.parametrize("field, value", [
    ("steps", 0), ("seq_len", 0), ("micro_batch_size", 0), ("grad_acc", -1), ("dp", 0), ("tp", 0), ("pp", 0),
    ("cp", 0), ("ep", 0), ("log_every", 0), ("timeout_s", 0), ("hidden_size", 0), ("num_hidden_layers", -2),
])
def test_sizes_and_steps_must_be_positive(field, value):
    msg = error_of(**{field: value})
    assert msg.startswith(f"{field}={value} must be a positive integer") and f"--{field.replace('_', '-')} 1" in msg


@pytest.mark.parametrize("field, value", [("save_every", -1), ("warmup_steps", -5), ("eval_every", -1), ("seed", -1)])
def test_counts_must_not_be_negative(field, value):
    assert error_of(**{field: value}).startswith(f"{field}={value} must be zero or more")


@pytest.mark.parametrize("lr", [0.0, -1e-3])
def test_lr_must_be_positive(lr):
    assert error_of(lr=lr).startswith(f"lr={lr} must be positive; pass --lr")


def test_optimizer_ranges():
    assert error_of(min_lr=0.01).startswith("min_lr=0.01 must lie between 0 and lr=0.003")
    assert error_of(beta2=1.0).startswith("beta2=1.0 must lie in [0, 1)")
    assert error_of(weight_decay=-0.1).startswith("weight_decay=-0.1 must not be negative")
    assert error_of(grad_clip=-1.0).startswith("grad_clip=-1.0 must not be negative")
    assert error_of(eval_batches=0).startswith("eval_every=50 needs eval_batches >= 1")
    validate(Config(eval_batches=0, eval_every=0), 1)


@pytest.mark.parametrize("field, value, listed", [
    ("preset", "gpt-5", "tiny, smollm-135m"), ("pp_schedule", "gpipe", "afab, 1f1b"), ("dtype", "fp64", "fp32, bf16"),
    ("recompute", "some", "none, selective, full"), ("dp_impl", "fast", "naive, overlap, bucket, ddp"), ("zero", 4, "0, 1, 2, 3"), ("device", "tpu", "auto, cpu, cuda"),
    ("attn_impl", "xformers", "sdpa, eager, flash"),
])
def test_unknown_names(field, value, listed):
    msg = error_of(**{field: value})
    assert msg.startswith(f"{field}={value!r} is not one of the known values") and listed in msg


def test_model_shape_rules():
    assert error_of(hidden_size=100).startswith("hidden_size=100 is not divisible by num_attention_heads=8")
    msg = error_of(num_key_value_heads=3)
    assert msg.startswith("num_key_value_heads=3 does not divide num_attention_heads=8") and "{1, 2, 4, 8}" in msg
    assert error_of(vocab_size=100).startswith("vocab_size=100 is too small for the byte tokenizer")


def test_data_source_must_exist(tmp_path):
    assert error_of(data=str(tmp_path / "missing.txt")).startswith("data='")
    (tmp_path / "a.txt").write_text("hello " * 1000)
    validate(Config(data=str(tmp_path / "a.txt")), 1)
    validate(Config(data="hf:roneneldan/TinyStories"), 1)  # checked later, by the loader


@pytest.mark.parametrize("fields", [dict(dp=2), dict(tp=2), dict(pp=2), dict(cp=2), dict(sp=True, tp=2),
                                    dict(zero=1, dp=2), dict(ep=2, dp=2, preset="tiny-moe")], ids=str)
def test_every_strategy_alone_is_valid(fields):
    validate(Config(**fields), Config(**fields).world_size)


def test_option_tuples_are_the_configs():
    """The values a setting may take are defined once, in picotron.config; the modules that name them use
    config's tuples themselves."""
    from picotron import context_parallel, kernels, pipeline_schedules, planner
    assert kernels.IMPLS is config.KERNELS and planner.RECOMPUTE is config.RECOMPUTE
    assert pipeline_schedules.SCHEDULES is config.PP_SCHEDULES
    assert (context_parallel.IMPLS, context_parallel.LAYOUTS) == (config.CP_IMPLS, config.CP_LAYOUTS)
    assert context_parallel.IMPLS is config.CP_IMPLS and context_parallel.LAYOUTS is config.CP_LAYOUTS


# ------------------------------------------------------------------------------------- JSON, flags, the CLI
def test_flags_override_json_which_overrides_defaults(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"steps": 7, "seq_len": 64, "sp": True, "lr": 1, "hidden_size": 64}))
    cfg = parse_args(["--config", str(path), "--seq-len", "32", "--no-sp", "--dtype", "bf16"])
    assert (cfg.steps, cfg.seq_len, cfg.sp, cfg.dtype, cfg.lr, cfg.hidden_size) == (7, 32, False, "bf16", 1.0, 64)
    assert isinstance(cfg.lr, float) and cfg.micro_batch_size == 16
    assert parse_args([]) == Config()
    assert parse_args(["--sp", "--resume", "--pp-schedule", "afab", "--micro-batch-size", "2"]) == Config(
        sp=True, resume=True, pp_schedule="afab", micro_batch_size=2)


def test_json_round_trip(tmp_path):
    cfg = Config(steps=3, dtype="bf16", num_hidden_layers=2)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert Config.load(str(path)) == cfg


@pytest.mark.parametrize("content, start", [
    ('{"dp": "2"}', "dp='2' in "), ('{"sp": 1}', "sp=1 in "), ('{"lr": true}', "lr=True in "),
    ('{"tensor_parallel": 2}', "'tensor_parallel' in "), ('{"steps": ', "config file "), ("[1, 2]", "config file "),
])
def test_bad_json(tmp_path, content, start):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(path)])
    assert one_sentence(str(e.value)).startswith(start)


def test_missing_json_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        parse_args(["--config", str(tmp_path / "nope.json")])


def test_cli_prints_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["--tp", "3"], world_size=1)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "picotron: error: tp=3 does not divide num_attention_heads=8; pick tp in {1, 2, 4}.\n"
    with pytest.raises(SystemExit) as e:
        cli(["--no-such-flag"], world_size=1)
    assert e.value.code == 2 and capsys.readouterr().err.startswith("picotron: error: unrecognized arguments")
    assert cli(["--steps", "3"], world_size=1).steps == 3


def _run(module, *argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


@pytest.mark.parametrize("module", ["picotron.train", "picotron.parallelize", "picotron.config"])
def test_command_line_exits_2_without_traceback(module):
    r = _run(module, "--tp", "3")
    assert r.returncode == 2, r.stderr
    assert r.stderr == "picotron: error: tp=3 does not divide num_attention_heads=8; pick tp in {1, 2, 4}.\n"
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize("module", ["picotron.parallelize", "picotron.config"])
def test_the_settings_module_prints_resolved_settings(module):
    r = _run(module, "--steps", "5", "--preset", "tiny")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["steps"] == 5


def test_zero_rejects_a_data_parallel_implementation():
    msg = error_of(dp=2, zero=2, dp_impl="ddp", world_size=2)
    assert msg == ("dp_impl='ddp' does not apply with zero=2 (ZeRO replaces the data-parallel wrapper: it "
                   "reduce-scatters the gradients itself); drop --dp-impl or use zero=0.")
    validate(Config(dp=2, zero=3), 2)


# ------------------------------------------------------------------------------------- devices and nodes
def _gpus(monkeypatch, n):
    """Pretend torch sees n CUDA GPUs (None: a CPU-only build)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: n is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n or 0)


def launcher_error(**fields):
    """What `python -m picotron.train ...` says before it starts torchrun (the processes are not there yet)."""
    with pytest.raises(ConfigError) as e:
        validate(Config(**fields), any_world_size=True)
    return one_sentence(str(e.value))


def test_more_processes_than_gpus_is_refused_before_torchrun_starts(monkeypatch):
    """`./run.sh --dp 2` on a one-GPU machine: before, it ran on the CPU without a word."""
    _gpus(monkeypatch, 1)
    assert launcher_error(dp=2) == ("2 processes per node need 2 GPUs (one each); this node has 1: pass --device cpu "
                                    "to run them on CPU with gloo, or run at most 1 process per node.")
    assert launcher_error(dp=8, device="cuda").startswith("--device cuda with 8 processes per node needs 8 GPUs")
    validate(Config(dp=2, device="cpu"), any_world_size=True)  # asked for: fine
    _gpus(monkeypatch, 8)
    validate(Config(dp=16, nnodes=2, rdzv_endpoint="node0:29500"), any_world_size=True)  # 8 per node, 8 GPUs
    assert "16 processes per node need 16 GPUs" in launcher_error(dp=16)
    _gpus(monkeypatch, None)
    validate(Config(dp=2), any_world_size=True)  # no GPU at all: cpu + gloo, silently (a laptop)


def test_under_torchrun_the_node_is_local_world_size(monkeypatch, capsys, tmp_path):
    """Plain `torchrun --nproc_per_node 2 -m picotron.train --dp 2` on a one-GPU machine: every worker validates
    with LOCAL_WORLD_SIZE (launch.place reads it, train.read_command passes it) before Mesh.init; rank 0 prints the
    sentence."""
    from picotron import launch, train

    _gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match="2 processes per node need 2 GPUs"):
        validate(Config(dp=2), 2, per_node=2)
    validate(Config(dp=2), 2, per_node=1)  # two nodes of one process: one GPU each is enough
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    with pytest.raises(SystemExit):
        train.read_command(["--dp", "2", "--out", str(tmp_path / "a")], launch.place(env))
    assert "2 processes per node need 2 GPUs" in capsys.readouterr().err
    one_each = launch.place({**env, "LOCAL_WORLD_SIZE": "1"})
    assert train.read_command(["--dp", "2", "--out", str(tmp_path / "b")], one_each).dp == 2


def test_node_rules():
    assert launcher_error(dp=6, nnodes=4) == (
        "dp*pp*cp*tp = 6 processes do not split evenly over nnodes=4 (every node runs the same number); pick "
        "--nnodes in {1, 2, 3, 6} or degrees whose product is a multiple of 4.")
    assert launcher_error(dp=2, nnodes=2).startswith("nnodes=2 needs a place where the nodes meet; pass --rdzv-endpoint")
    assert launcher_error(dp=2, nnodes=2, rdzv_endpoint="node0").startswith("rdzv_endpoint='node0' is not HOST:PORT;")
    assert launcher_error(dp=4, nnodes=2, node_rank=2, rdzv_endpoint="h:1") == (
        "node_rank=2 is not a node of nnodes=2; pass --node-rank 0 on the --rdzv-endpoint host and 1 on the other.")
    assert "must be a positive integer" in launcher_error(nnodes=0)
    validate(Config(dp=4, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500"), any_world_size=True)
    cfg = parse_args(["--dp", "4", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29500",
                      "--rdzv-id", "job7"])
    assert (cfg.nnodes, cfg.node_rank, cfg.rdzv_endpoint, cfg.rdzv_id) == (2, 1, "h:29500", "job7")


def test_tensor_and_context_peers_across_nodes_are_named():
    note = config.placement_note
    assert note(Config(tp=16), 8) == ("tp = 16 spans 2 nodes of 8 processes: their per-layer traffic would cross "
                                      "the network; keep tp <= 8.")
    assert note(Config(tp=8, cp=2), 8).startswith("tp·cp = 16 spans 2 nodes of 8 processes")
    assert note(Config(dp=2, tp=4), 6).startswith("tp = 4 does not divide the 6 processes per node, so some tp groups "
                                                  "straddle two nodes")
    assert note(Config(dp=2, tp=8), 8) is None and note(Config(dp=16), 8) is None  # dp crosses nodes: fine
    assert note(Config(tp=2), 2) is None and note(Config(cp=4), 1).startswith("cp = 4 spans 4 nodes of 1 process:")
