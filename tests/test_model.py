"""picotron.model against Hugging Face's Llama, plus init, recomputation, presets and generation."""
import json

import pytest
import safetensors  # noqa: F401
import torch
import torch.nn.functional as F
import transformers  # requirements.txt: the reference implementation, so never skipped

from picotron import marks
from picotron.model import PRESETS, Llama, ModelConfig, generate, init_tensor

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500.0)


def small_config(kv_heads=2, tied=False, **kw):
    return ModelConfig(**{**SMALL, "num_key_value_heads": kv_heads, "tie_word_embeddings": tied, **kw})


def hf_config(cfg: ModelConfig):
    hf = transformers.LlamaConfig(**cfg.to_dict())
    hf._attn_implementation = "eager"
    return hf


def random_model(cfg, seed=0):
    """Our model with random weights, norms included (init_weights sets them to 1, which hides bugs)."""
    model = Llama(cfg).init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


def to_hf_state(model):
    return {(k if k.startswith("lm_head.") else "model." + k): v for k, v in model.state_dict().items()}


def tokens(b=2, s=24, vocab=96, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- parity with transformers
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_logits_match_transformers(kv_heads, tied, attn_impl):
    cfg = small_config(kv_heads, tied, attn_impl=attn_impl)
    ours = random_model(cfg).eval()
    hf = transformers.LlamaForCausalLM(hf_config(cfg)).eval()
    hf.load_state_dict(to_hf_state(ours), strict=True)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=1e-5)
        pos = torch.arange(x.shape[1]) + 7  # explicit, shifted positions (what context parallelism passes)
        torch.testing.assert_close(ours(x, position_ids=pos), hf(x, position_ids=pos[None]).logits,
                                   rtol=0, atol=1e-5)


def test_gradients_match_transformers():
    cfg = small_config(kv_heads=2)
    ours = random_model(cfg)
    hf = transformers.LlamaForCausalLM(hf_config(cfg))
    hf.load_state_dict(to_hf_state(ours))
    x, y = tokens(), tokens(seed=1)
    F.cross_entropy(ours(x).flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        key = name if name.startswith("lm_head.") else "model." + name
        torch.testing.assert_close(p.grad, hf_grads[key], rtol=0, atol=1e-5, msg=name)


def test_causal():
    for impl in ("sdpa", "eager"):
        model = random_model(small_config(attn_impl=impl))
        x = tokens(s=16)
        x2 = x.clone()
        x2[:, -1] = (x2[:, -1] + 1) % 96
        with torch.no_grad():
            torch.testing.assert_close(model(x)[:, :-1], model(x2)[:, :-1], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- HF files
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_hf_from_hf_round_trip_and_transformers_reads_it(tmp_path, tied):
    ours = random_model(small_config(tied=tied))
    ours.save_hf(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    back = Llama.from_hf(tmp_path)
    assert back.config == ours.config
    assert back.num_params() == ours.num_params()
    assert (back.lm_head.weight is back.embed_tokens.weight) == tied
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert all(p.requires_grad for p in back.parameters())
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(x), hf(x).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_from_hf_reads_save_pretrained(tmp_path, sharded, tied):
    cfg = small_config(tied=tied)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config(cfg)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p))
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    ours = Llama.from_hf(tmp_path)
    assert ours.config.to_dict() == {**cfg.to_dict()}
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=1e-5)
    half = Llama.from_hf(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


def test_config_dict_round_trip_and_errors():
    for name in PRESETS:
        cfg = ModelConfig.from_preset(name)
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    v4 = {k: v for k, v in small_config().to_dict().items() if k != "rope_parameters"}  # transformers 4
    assert ModelConfig.from_hf_dict(v4).rope_theta == 500.0
    llama31 = {**v4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ValueError, match="rope_type='llama3'"):
        ModelConfig.from_hf_dict(llama31)
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        ModelConfig.from_preset("nope")
    assert ModelConfig.from_preset("tiny", num_hidden_layers=2).num_hidden_layers == 2


# ---------------------------------------------------------------------------------------------- init
def test_init_tensor_depends_only_on_seed_name_shape():
    a = init_tensor("layers.0.mlp.up_proj.weight", (8, 4), seed=1, std=0.02)
    assert torch.equal(a, init_tensor("layers.0.mlp.up_proj.weight", (8, 4), seed=1, std=0.02))
    assert not torch.equal(a, init_tensor("layers.1.mlp.up_proj.weight", (8, 4), seed=1, std=0.02))
    assert not torch.equal(a, init_tensor("layers.0.mlp.up_proj.weight", (8, 4), seed=2, std=0.02))
    assert abs(init_tensor("w", (256, 256), 0, 0.02).std().item() - 0.02) < 1e-3


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_meta_build_then_init_equals_direct(tied):
    cfg = small_config(tied=tied)
    direct = Llama(cfg).init_weights(seed=5)
    with torch.device("meta"):
        meta = Llama(cfg)
    meta.to_empty(device="cpu").init_weights(seed=5)
    assert (meta.lm_head.weight is meta.embed_tokens.weight) == tied
    for (n1, p1), (n2, p2) in zip(direct.state_dict().items(), meta.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert torch.equal(direct.layers[1].input_layernorm.weight, torch.ones(cfg.hidden_size))
    L, std = cfg.num_hidden_layers, cfg.initializer_range
    assert torch.equal(direct.layers[0].mlp.down_proj.weight,
                       init_tensor("layers.0.mlp.down_proj.weight", (64, 160), 5, std / (2 * L) ** 0.5))
    assert not torch.equal(direct.layers[0].self_attn.q_proj.weight, direct.layers[1].self_attn.q_proj.weight)


def test_init_sharded_parameter_gets_its_slice_of_the_full_tensor():
    """The hook strategies use: a parameter placed as a slice (picotron.marks: the full shape, the slice's
    offsets in it) receives that slice of the full tensor."""
    cfg = small_config()
    full = Llama(cfg).init_weights(seed=3)
    model = Llama(cfg)
    attn = model.layers[0].self_attn
    attn.q_proj.weight = torch.nn.Parameter(torch.empty(32, 64))  # rank 1 of 2, column-parallel
    marks.place(attn.q_proj, "weight", dims=("tp",), shape=(64, 64), offsets=(32, 0), split_dim=0)
    model.init_weights(seed=3)
    assert torch.equal(attn.q_proj.weight, full.layers[0].self_attn.q_proj.weight[32:])


# ------------------------------------------------------------------------------------ recomputation
@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_recompute_modes_give_equal_loss_and_grads(attn_impl):
    model = random_model(small_config(attn_impl=attn_impl))
    x, y = tokens(), tokens(seed=1)
    results = {}
    for mode in ("none", "selective", "full"):
        model.zero_grad(set_to_none=True)
        model.recompute = mode
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        results[mode] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_loss, ref_grads = results["none"]
    for mode in ("selective", "full"):
        loss, grads = results[mode]
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=1e-7, msg=f"{mode}: {n}")
    model.recompute = "sometimes"
    with pytest.raises(ValueError, match="recompute="):
        model(x)


class _TwoRanksInOne:
    """A partition for recompute="partitioned" in one process: "this rank" keeps the first half of the hidden
    columns, the second half stands for the other rank's piece (kept aside, as that rank would keep it)."""

    def __init__(self):
        self.others, self.rebuilt = [], 0

    def keep(self, x):
        mine, other = x.detach().chunk(2, dim=-1)
        self.others.append(other.clone())
        return mine.clone()

    def rebuild(self, piece):  # backward runs the layers last to first
        self.rebuilt += 1
        return torch.cat([piece, self.others.pop()], dim=-1)


def test_partitioned_recompute_keeps_the_piece_and_gives_full_recomputes_grads():
    """model.checkpoint_partitioned: the same loss and gradients as full recomputation (exactly: the same ops on the
    same numbers), each layer's saved input cut to the piece `keep` returns, rebuilt once per layer in backward."""
    from picotron.metrics import ActivationCounter
    cfg = small_config()
    model = random_model(cfg)
    x, y = tokens(), tokens(seed=1)
    results = {}
    for mode in ("full", "partitioned"):
        model.zero_grad(set_to_none=True)
        model.recompute, model.partition = mode, _TwoRanksInOne()
        with ActivationCounter(model) as counter:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        results[mode] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counter.bytes
    assert model.partition.rebuilt == cfg.num_hidden_layers and not model.partition.others
    (ref_loss, ref_grads, full_bytes), (loss, grads, part_bytes) = results["full"], results["partitioned"]
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=0, msg=f"partitioned: {n}")
    b, s = x.shape
    layer_input = 4 * b * s * cfg.hidden_size  # fp32 [b, s, h]
    assert full_bytes - part_bytes == cfg.num_hidden_layers * layer_input // 2, (full_bytes, part_bytes)
    with torch.no_grad():  # no backward, nothing to save: the layers run as they are
        logits = model(x)
        model.recompute = "none"
        assert torch.equal(logits, model(x)) and not model.partition.others
    model.recompute, model.partition = "partitioned", None
    with pytest.raises(ValueError, match="recompute='partitioned' needs a partition"):
        model(x)


# ------------------------------------------------------------------------------ presets and counting
@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_matches_module(name):
    cfg = ModelConfig.from_preset(name)
    with torch.device("meta"):
        model = Llama(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters()) == model.num_params()
    published = {"smollm-135m": 134_515_008, "smollm-360m": 361_821_120,
                 "smollm-1.7b": 1_711_376_384, "llama3-8b": 8_030_261_248}
    if name in published:
        assert cfg.num_params() == published[name]
    # every parameter a token uses in a matmul costs 6 FLOPs (with experts: the k of E it is routed to)
    assert cfg.flops_per_token(1024) > 6 * (cfg.num_params(active=True) - cfg.vocab_size * cfg.hidden_size)
    if cfg.is_moe:
        assert cfg.num_params(active=True) < cfg.num_params()


def test_bf16_runs():
    model = random_model(small_config())
    x = tokens()
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(x)
        half = model.to(torch.bfloat16)(x)
    assert half.dtype == torch.bfloat16
    for out in (auto, half):
        assert (out.float() - ref).abs().max() < 0.2 * ref.abs().max()


# ---------------------------------------------------------------------------------------- generation
def test_generate():
    cfg = small_config()
    cfg.max_position_embeddings = 16
    model = random_model(cfg).eval()
    prompt = tokens(b=2, s=5)
    greedy = generate(model, prompt, 20, temperature=0)  # runs past max_position_embeddings: cropped
    assert greedy.shape == (2, 25) and torch.equal(greedy[:, :5], prompt)
    with torch.no_grad():
        assert torch.equal(greedy[:, 5], model(prompt)[:, -1].argmax(-1))
    assert torch.equal(generate(model, prompt, 20, top_k=1), greedy)
    sample = lambda seed: generate(model, prompt, 8, temperature=0.8, top_k=10,
                                   generator=torch.Generator().manual_seed(seed))
    assert torch.equal(sample(0), sample(0)) and not torch.equal(sample(0), sample(1))
