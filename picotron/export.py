"""Export a checkpoint, written at any layout, to the Hugging Face layout (`transformers` loads it as is).

    python -m picotron.export runs/main hf_model/            # the run's newest checkpoint
    python -m picotron.export runs/main/checkpoints/step_000120 hf_model/ --dtype bf16

The checkpoint's slices are assembled into whole tensors (`reshard.consolidate`, one process, no process
group), put into a one-process Llama, and written as `config.json` + `model.safetensors`
(`LlamaForCausalLM`, or `MixtralForCausalLM` for a mixture-of-experts model). Adam's state is not exported. A
model with DeepSeek-V3's routing (picotron.moe) is refused: transformers' Mixtral would load it and route otherwise.

The tokenizer goes with it, so `AutoTokenizer.from_pretrained(directory)` works too. picotron's default model
reads UTF-8 bytes (picotron.data.ByteTokenizer: token id = byte value, 256 ids, no special tokens), written here
as a `tokenizer.json` of the `tokenizers` library: GPT-2's byte-level pre-tokenizer (each byte becomes one
printable character, `bytes_to_unicode`) and a BPE model with those 256 characters as its vocabulary and no
merges, so every byte is one token whose id is the byte's value, and decoding maps the characters back to bytes
(invalid UTF-8 becomes U+FFFD, as picotron's decode does). A run with `--tokenizer NAME` gets NAME's own files.
"""
import argparse
import json
import os
import sys

import torch

from picotron import checkpoint, reshard
from picotron.config import Config
from picotron.model import Llama
from picotron.model_config import DEEPSEEK, ModelConfig


def folder_of(path):
    """A checkpoint folder from a run's output folder (its newest checkpoint) or a checkpoint folder itself."""
    if os.path.exists(os.path.join(path, "config.json")) and any(f.startswith("rank_") for f in os.listdir(path)):
        return path
    newest = checkpoint.latest(path)
    if newest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint folder nor a run folder with checkpoints/latest; "
                                f"pass a run's --out folder after a run with --save-every, or a step_* folder.")
    return newest


def bytes_to_unicode():
    """GPT-2's map from the 256 byte values to printable characters: the printable ones map to themselves, the
    others (controls, space, ...) to the characters from U+0100 on, in byte order (space -> 'Ġ', newline -> 'Ċ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def save_byte_tokenizer(directory, model_max_length):
    """Write picotron's byte tokenizer (token id = UTF-8 byte value) as tokenizer.json + tokenizer_config.json."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise ImportError("writing the tokenizer needs the 'tokenizers' package, which comes with transformers: "
                          "pip install transformers") from None

    tok = Tokenizer(models.BPE(vocab={char: b for b, char in bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # no word splitting
    tok.decoder = decoders.ByteLevel()
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast",  # the generic class: it reads tokenizer.json as is
                "clean_up_tokenization_spaces": False,  # decode gives back the very text: "a ." stays "a ."
                "model_max_length": model_max_length}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f, indent=2)


def export(path, directory, dtype=None):
    """Write the checkpoint at `path` and its tokenizer to `directory` in the Hugging Face layout; return the
    model (CPU), the checkpoint folder and its step."""
    folder = folder_of(path)
    whole = reshard.consolidate(folder)
    cfg = Config.from_dict(whole["config"], source=path)
    mc = cfg.model_config()
    deepseek = {k: getattr(mc, k) for k in DEEPSEEK if getattr(mc, k) != getattr(ModelConfig, k)}
    if mc.is_moe and deepseek:  # transformers' Mixtral would load it and route otherwise, silently
        fields = ", ".join(f"{k}={v!r}" for k, v in deepseek.items())
        raise ValueError(f"{path} holds a model with DeepSeek-V3's routing fields ({fields}), which transformers' "
                         f"Mixtral, the layout picotron.export writes, does not have (softmax routing, no shared "
                         f"experts, no routing bias); load the checkpoint with picotron (--resume-from) instead.")
    with torch.device("meta"):
        model = Llama(cfg.model_config())
    model.to_empty(device="cpu")
    state = dict(whole["params"])
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    if dtype is not None:
        model.to(dtype)
    if cfg.tokenizer == "byte":  # the tokenizer first: one that cannot be written stops the export before the weights
        save_byte_tokenizer(directory, mc.max_position_embeddings)
    else:
        from picotron.data import get_tokenizer
        get_tokenizer(cfg.tokenizer).tok.save_pretrained(directory)
    model.save_hf(directory)
    return model, folder, whole["step"]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m picotron.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a run's --out folder (its newest checkpoint) or a checkpoint folder")
    p.add_argument("directory", help="where to write config.json, model.safetensors and the tokenizer's files")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = p.parse_args(argv)
    try:
        model, folder, step = export(args.checkpoint, args.directory, torch.bfloat16 if args.dtype == "bf16" else None)
    except (FileNotFoundError, ValueError, KeyError, ImportError) as e:
        print(f"picotron.export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.directory}: step {step} ({folder}), {model.config.num_params() / 1e6:.2f} M parameters "
          f"({args.dtype}) and its tokenizer, loadable with transformers' AutoModelForCausalLM and "
          f"AutoTokenizer.from_pretrained({args.directory!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
