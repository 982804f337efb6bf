"""The single-process reference, trained once per settings in a test session.

Every parity test compares a layout's run with one process on the same global batch (the parity standard,
tests/_parity.py). A reference depends only on the function that trains it and its settings, so each distinct one
is trained once per pytest session, here, and every test that asks again (in this module or another) gets the
same result: the expert tests' ten layouts at dp = 2 and 4 need two references, not ten.

`PARITY` is the one small setting the parity tests share: 3 steps of the tiny model (32 tokens, micro-batch 2), with
clipping and a validation loss at step 3, so a layout's loss, gradient norm, clipped update and val loss are all
compared. A test adds only what it is about (its layout, a preset, a model setting).
"""
import atexit
import shutil
import tempfile

from picotron.launch import run_on_ranks

PARITY = dict(seq_len=32, micro_batch_size=2, sample_tokens=0, log_every=1000, eval_every=3, eval_batches=1, lr=3e-3,
              warmup_steps=2, steps=3, grad_clip=1.0)

_CACHE = {}
_FOLDER = []


def _folder():
    """One temporary folder for the session's references, removed when the session ends."""
    if not _FOLDER:
        _FOLDER.append(tempfile.mkdtemp(prefix="picotron-references-"))
        atexit.register(shutil.rmtree, _FOLDER[0], True)
    return _FOLDER[0]


def single_process(child, settings, timeout_s=180):
    """`child(settings, out)` run on one process (run_on_ranks), once per (child, settings) in this session; its
    result is shared by every caller, so a test must not change it."""
    key = (child.__module__, child.__qualname__, tuple(sorted((k, repr(v)) for k, v in settings.items())))
    if key not in _CACHE:
        out = tempfile.mkdtemp(dir=_folder())
        _CACHE[key] = run_on_ranks(child, 1, dict(settings), out, timeout_s=timeout_s)[0]
    return _CACHE[key]
