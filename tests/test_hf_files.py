"""Hugging Face files as the installed transformers writes them, both ways: `save_pretrained` -> `Llama.from_hf`,
and picotron's `save_hf` (what `python -m picotron.export` writes) -> transformers' `from_pretrained`; and the byte
tokenizer export writes beside it, which `AutoTokenizer` loads with picotron's ids (issue 41).

test_model.py builds each config from picotron's own `to_dict`, so it never meets the nulls and defaults of a
config.json that transformers wrote itself (MixtralConfig writes "head_dim": null: issue 30).
"""
import json

import pytest
import torch
import transformers  # requirements.txt: the reference implementation, so never skipped

from picotron.model import HF_DEFAULTS, Llama, ModelConfig

SIZES = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}


def hf_rope_theta(config):
    return (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))


def written(model_type, **kw):
    """A transformers model of that type with random weights (norms and routers too: ones hide bugs), and only
    `kw` set: every other key in its config.json is whatever this transformers writes by default."""
    config_cls, model_cls = CLASSES[model_type]
    config = config_cls(**SIZES, **kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.5 * torch.randn_like(p))
            elif name.endswith("gate.weight") and model_type == "mixtral":  # the router: uneven expert loads
                p.normal_(0, 0.5)
    return model


def logits(model, seed=0):
    x = torch.randint(0, SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", out)


CASES = {  # model_type, what is set; the rest is transformers' defaults, nulls included
    "llama-untied-gqa": ("llama", dict(num_key_value_heads=2)),
    "llama-tied-mha-kv-null": ("llama", dict(num_key_value_heads=None, tie_word_embeddings=True)),
    "llama-eps-theta": ("llama", dict(num_key_value_heads=1, rms_norm_eps=1e-3, rope_parameters=dict(
        rope_type="default", rope_theta=321.0))),
    "mixtral-head-dim-null": ("mixtral", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-tied": ("mixtral", dict(num_key_value_heads=4, num_local_experts=3, num_experts_per_tok=1,
                                     tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_save_pretrained_loads_in_picotron_and_its_export_loads_in_transformers(tmp_path, case):
    """transformers -> picotron -> transformers: logits equal at each step (fp32, 1e-5), and the config is read
    as transformers reads it (the nulls it writes included)."""
    model_type, kw = CASES[case]
    theirs = written(model_type, **kw)
    theirs.save_pretrained(tmp_path / "theirs")
    on_disk = json.loads((tmp_path / "theirs" / "config.json").read_text())
    if model_type == "mixtral":
        assert on_disk["head_dim"] is None  # what issue 30's user met: picotron raised a TypeError here
    ours = Llama.from_hf(tmp_path / "theirs")
    c, hc = ours.config, theirs.config
    assert (c.num_key_value_heads, c.rms_norm_eps, c.rope_theta, c.tie_word_embeddings, c.num_local_experts) == \
        (hc.num_key_value_heads, hc.rms_norm_eps, hf_rope_theta(hc), hc.tie_word_embeddings,
         getattr(hc, "num_local_experts", 0))
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == c.tie_word_embeddings
    want = logits(theirs)
    torch.testing.assert_close(logits(ours), want, rtol=0, atol=1e-5)

    ours.save_hf(tmp_path / "ours")  # picotron.export writes with this
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    assert type(back) is type(theirs)
    assert Llama.from_hf(tmp_path / "ours").config == ours.config
    torch.testing.assert_close(logits(back), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", list(HF_DEFAULTS))
def test_an_absent_key_means_transformers_default(model_type):
    """HF_DEFAULTS are the installed transformers' own, and a config.json that leaves every optional key out
    reads as the same model as the full file transformers writes for it."""
    config_cls, _ = CLASSES[model_type]
    theirs = config_cls()
    for key, value in HF_DEFAULTS[model_type].items():
        got = hf_rope_theta(theirs) if key == "rope_theta" else getattr(theirs, key)
        assert value == got or (key, value) == ("num_key_value_heads", None) and got == theirs.num_attention_heads, key
    assert ModelConfig.from_hf_dict({"model_type": model_type}) == ModelConfig.from_hf_dict(theirs.to_dict())
    sparse = {"model_type": model_type, **SIZES, "head_dim": None, "num_key_value_heads": None, "rope_scaling": None}
    full = config_cls(**SIZES, num_key_value_heads=SIZES["num_attention_heads"]).to_dict()
    assert ModelConfig.from_hf_dict(sparse) == ModelConfig.from_hf_dict(full)


def test_transformers_4_spelling():
    """transformers 4 wrote rope_theta at the top, rope_scaling (null or a dict with "type") and no head_dim."""
    v4 = {"model_type": "llama", **SIZES, "num_key_value_heads": 2, "rope_theta": 5e5, "rope_scaling": None,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    c = ModelConfig.from_hf_dict(v4)
    assert (c.rope_theta, c.num_key_value_heads, c.tie_word_embeddings, c.head_dim) == (5e5, 2, True, 16)
    with pytest.raises(ValueError, match="rope_type='linear'"):
        ModelConfig.from_hf_dict({**v4, "rope_scaling": {"type": "linear", "factor": 2.0}})


REFUSED = {  # a field picotron cannot honour, and what its sentence must name
    "head_dim": ({"head_dim": 32}, r"head_dim=32, .* = 64/4 = 16"),
    "llama3 rope": ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
                    "rope_type='llama3'"),
    "yarn rope (4.x)": ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    "partial rope": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    "attention bias": ({"attention_bias": True}, "attention_bias=true, .* no bias"),
    "mlp bias": ({"mlp_bias": True}, "mlp_bias=true"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "kv heads": ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    "sliding window": ({"model_type": "mixtral", "sliding_window": 4096}, "sliding_window=4096"),
    "dropout": ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    "router noise": ({"model_type": "mixtral", "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    "other family": ({"model_type": "qwen2"}, "model_type='qwen2'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_picotron_cannot_honour_is_one_sentence(case):
    edit, pattern = REFUSED[case]
    d = {"model_type": "llama", **SIZES, "num_key_value_heads": 2, **edit}
    with pytest.raises(ValueError, match=pattern) as e:
        ModelConfig.from_hf_dict(d)
    message = str(e.value)
    assert message.endswith(".") and ". " not in message and "\n" not in message, message


def test_from_hf_names_the_file_it_refuses(tmp_path):
    written("llama", num_key_value_heads=2, head_dim=32).config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"config\.json: unsupported llama config: head_dim=32"):
        Llama.from_hf(tmp_path)


# ------------------------------------------------------------------ the tokenizer picotron.export writes
TEXTS = ["Ünïcode — ok", "ROMEO:\n\tBut, soft!  what light  .", "日本語 🎉", "", "a" * 40]


def test_the_byte_tokenizer_loads_in_transformers_with_picotrons_ids(tmp_path):
    """AutoTokenizer reads what export writes for the byte tokenizer: the ids are picotron's (the UTF-8 bytes),
    decoding gives the text back, and invalid UTF-8 decodes as picotron's decode does (U+FFFD)."""
    from picotron.data import ByteTokenizer
    from picotron.export import save_byte_tokenizer

    save_byte_tokenizer(tmp_path, model_max_length=64)
    theirs, ours = transformers.AutoTokenizer.from_pretrained(tmp_path), ByteTokenizer()
    assert len(theirs) == ours.vocab_size == 256 and theirs.all_special_ids == []  # no ids beyond the bytes
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ids == ours.encode(text) == list(text.encode("utf-8")), text
        assert theirs.decode(ids) == text
    for ids in ([0xE2, 0x80, 0x41], [0xC3], [0xFF, 0x41, 0xE2, 0x80, 0x94, 0xF0, 0x9F]):  # cut or invalid UTF-8
        assert theirs.decode(ids) == ours.decode(ids)


def test_an_exported_checkpoint_generates_text_with_transformers(tmp_path, capsys):
    """A tiny run's checkpoint -> `python -m picotron.export` -> AutoTokenizer + AutoModelForCausalLM: the prompt
    becomes picotron's ids, greedy generation continues it as picotron's own generate does, and the tokenizer
    decodes the continuation as picotron does. The printed line names the step exported."""
    from picotron import export
    from picotron.config import Config
    from picotron.data import ByteTokenizer
    from picotron.mesh import Mesh
    from picotron.model import generate
    from picotron.train import train

    run = Config(steps=3, save_every=3, out=str(tmp_path / "run"), sample_tokens=0, log_every=1000, eval_every=0,
                 seq_len=32, micro_batch_size=4)
    with Mesh.init() as mesh:
        train(run, mesh)
    capsys.readouterr()
    assert export.main([run.out, str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr().out
    assert "step 3 (" in printed and "step_000003" in printed, printed
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    prompt = tok("Ünïcode — ", return_tensors="pt")
    assert prompt["input_ids"][0].tolist() == ByteTokenizer().encode("Ünïcode — ")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
        ours = generate(Llama.from_hf(tmp_path / "hf").eval(), prompt["input_ids"], 12, temperature=0)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 12) and torch.equal(out, ours)
    assert tok.decode(out[0]) == ByteTokenizer().decode(out[0])
