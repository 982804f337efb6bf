"""The torch releases picotron runs on, and the one place that copes with their differences.

A pod comes with its own torch (a CUDA build matched to its driver); picotron uses it as it is, from the floor
below up to the newest release, rather than asking for a multi-GB reinstall. Three things live here:

- `require_torch()`: `import picotron` refuses, in one sentence, a torch older than `FLOOR` (it reads the installed
  version without importing torch, so that every launched process can still set OMP_NUM_THREADS first).
- `collective(ops, name)`: the differences in torch.distributed's names, detected by `hasattr`, never by version.
  torch 2.13 renamed the tensor forms of all-gather and reduce-scatter (`all_gather_single`,
  `reduce_scatter_single`) and deprecated the old names, which still work but warn in every process; every torch
  from the floor has the old names (`all_gather_into_tensor`, `reduce_scatter_tensor`), with the same arguments.
  So the code names a collective by its old name and calls it through here: the newest spelling the `ops` at
  hand offers (torch.distributed, picotron.collectives for `--collectives ours`, an emulated link's ops) runs.
- `missing(feature)`: torch's own implementations that only the side-by-side comparisons use (benchmarks/ and the
  lessons that quote them: FSDP2, DTensor tensor parallelism, torch.distributed.pipelining's shape inference). They
  came after the floor; picotron itself never needs them, so on an older torch a comparison says one sentence (and
  its test skips with it) instead of failing deep inside.

What the floor promises: picotron itself (the model, every strategy, checkpoints, the command line) runs and matches
one process. What needs a newer torch, on CPUs: torch 2.5's gloo has no list-form
reduce_scatter or all_to_all (tests/test_collectives.py and lesson 02 compare ours with them), and torch 2.5 to 2.7
compute grouped-query attention on the CPU with the unfused math kernel (right values, but it keeps the s x s scores,
so lesson 01's measured activations exceed the formula's); torch 2.13 has both.

The smoke subset (tests/smoke_oldtorch.txt) runs on the floor's torch in CI (.ci/smoke-oldtorch): raise FLOOR,
requirements.txt's `torch>=` and the pin there together (tests/test_compat.py checks they agree).
"""
import importlib
import inspect
from importlib import metadata

# The floor: torch 2.5, for F.scaled_dot_product_attention(..., enable_gqa=True), the grouped-query attention of the
# model, of context parallelism's blocks and of the lessons (torch 2.4 raises TypeError at the first forward).
FLOOR = (2, 5)
FLOOR_TEXT = ".".join(map(str, FLOOR))

# the old name (every torch from the floor) -> the name torch 2.13 gave the same collective
RENAMED = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}


def collective(ops, name):
    """`ops`'s collective `name` (an old name: all_gather_into_tensor, ...), under its newer name where `ops` has it."""
    return getattr(ops, RENAMED.get(name, name), None) or getattr(ops, name)


def _release(version):
    """(major, minor) of a torch version string: '2.4.1+cu121' -> (2, 4); '2.5.0a0+git3bcc3cd' -> (2, 5)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def installed_torch():
    """The installed torch's version string (from its package metadata: torch itself is not imported), or None."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # no torch (or a source tree on the path): importing torch will say
        return None


def require_torch(version=None):
    """Raise ImportError, one sentence, if torch (`version`, or the installed one) is older than FLOOR."""
    version = installed_torch() if version is None else version
    if version is not None and _release(version) < FLOOR:
        raise ImportError(f"picotron needs torch >= {FLOOR_TEXT} (found {version}): pip install 'torch>={FLOOR_TEXT}' "
                          f"(or a pod image whose torch is {FLOOR_TEXT} or newer).")


def _has(module, name):
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _pipeline_stage_infers_shapes():
    """torch.distributed.pipelining.PipelineStage without example inputs (input_args optional: torch 2.6 on)."""
    try:
        from torch.distributed.pipelining import PipelineStage
    except ImportError:
        return False
    arg = inspect.signature(PipelineStage.__init__).parameters.get("input_args")
    return arg is None or arg.default is not inspect.Parameter.empty


# feature -> (is it there?, what it is). All came with torch 2.6.
NEWER = {"fsdp2": (lambda: _has("torch.distributed.fsdp", "fully_shard"),
                   "torch.distributed.fsdp.fully_shard (FSDP2)"),
         "dtensor_tp": (lambda: _has("torch.nn.utils", "get_total_norm"),
                        "DTensor tensor parallelism with torch.nn.utils.get_total_norm"),
         "pipelining": (_pipeline_stage_infers_shapes,
                        "torch.distributed.pipelining's PipelineStage without input_args")}


def missing(feature):
    """None if this torch has `feature` (a key of NEWER), else one sentence: what is missing and the fix."""
    present, what = NEWER[feature]
    if present():
        return None
    import torch

    found = torch.__version__.split("+")[0]
    return (f"this comparison needs {what}, which torch {found} lacks: it came with torch 2.6 (pip install "
            f"'torch>=2.6'); picotron itself runs on torch >= {FLOOR_TEXT}.")
