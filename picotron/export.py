"""Export a checkpoint, written at any layout, to the Hugging Face layout (`transformers` loads it as is).

    python -m picotron.export runs/main hf_model/            # the run's newest checkpoint
    python -m picotron.export runs/main/checkpoints/step_000120 hf_model/ --dtype bf16

The checkpoint's slices are assembled into whole tensors (`reshard.consolidate`, one process, no process
group), put into a one-process Llama, and written as `config.json` + `model.safetensors`
(`LlamaForCausalLM`, or `MixtralForCausalLM` for a mixture-of-experts model). Adam's state is not exported. A
model with DeepSeek-V3's routing (picotron.moe) is refused: transformers' Mixtral would load it and route otherwise.
"""
import argparse
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


def export(path, directory, dtype=None):
    """Write the checkpoint at `path` to `directory` in the Hugging Face layout; return the model (CPU)."""
    whole = reshard.consolidate(folder_of(path))
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
    model.save_hf(directory)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m picotron.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a run's --out folder (its newest checkpoint) or a checkpoint folder")
    p.add_argument("directory", help="where to write config.json and model.safetensors")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = p.parse_args(argv)
    try:
        model = export(args.checkpoint, args.directory, torch.bfloat16 if args.dtype == "bf16" else None)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"picotron.export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.directory}: {model.config.num_params() / 1e6:.2f} M parameters ({args.dtype}), loadable "
          f"with transformers' AutoModelForCausalLM.from_pretrained({args.directory!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
