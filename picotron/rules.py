"""The rules a run's settings must follow, checked before any process starts, and without torch.

    $ python -m picotron.train --tp 3
    picotron: error: tp=3 does not divide num_attention_heads=8; pick tp in {1, 2, 4}.

`validate(cfg)` raises ConfigError with one sentence (the value, the rule and a fix) for the first broken rule:

    1. the settings themselves (picotron.config.check: names, ranges, the model's shape, faults, nodes);
    2. each strategy's own, `<strategy>_rule(cfg, model_config)` -> the sentence or None: one section each below,
       and each strategy module names its rule `check` (tensor_parallel.check is `tensor_parallel_rule`);
    3. which strategies combine: `combination_problem`, one table;
    4. the inputs: the tokenizer, the data and the checkpoint to resume from;
    5. the devices (`device_problem`) and the world size.

Why a module of its own: the strategies' modules import torch, which takes seconds (a minute on a busy machine),
and a refusal should take a blink. Nothing here imports torch, except where a rule needs it: counting the GPUs
for several processes on --device auto or cuda, --kernels triton, and a Hugging Face tokenizer (transformers).
"""

from picotron import config, runs, text
from picotron.config import ConfigError
from picotron.pipeline_schedules import chunks_of


# ====================================================================================== tensor parallelism
def tensor_parallel_rule(cfg, model_config):
    """Tensor (and sequence) parallelism's own rules: the one-sentence problem with these settings, or None
    (which strategies combine with it: `combination_problem`).

    tp splits the query heads, the KV heads, the MLP columns and the vocabulary into tp equal slices, whole
    heads per rank (no KV-head replication here); sp splits each rank's sequence over the tp ranks; recompute
    "partitioned" splits each layer's saved input over the tp ranks, which hold it whole only without sp."""
    tp = cfg.tp
    problem = tp_shape_problem(model_config, tp)
    if problem:
        return problem
    if cfg.recompute == "partitioned" and tp == 1:
        return ("recompute='partitioned' with tp=1 has nothing to partition (it splits each layer's saved input over "
                "the tp ranks, which hold identical copies); use --recompute full, or add --tp 2 or more.")
    if cfg.recompute == "partitioned" and cfg.sp:
        return ("recompute='partitioned' with --sp is already what --recompute full does (sequence parallelism splits "
                "each layer's input over the tp ranks, so full recomputation keeps 1/tp of it); use --recompute full.")
    if cfg.sp and (cfg.seq_len // cfg.cp) % tp:
        return (f"sp with tp={tp} needs the local sequence length seq_len/cp={cfg.seq_len // cfg.cp} divisible by "
                f"tp (the sequence is split over tp ranks); pass a seq_len that is a multiple of {tp * cfg.cp}.")
    return None


def tp_shape_problem(mc, tp, padded=False):
    """Whether tp cuts the model's heads, KV heads, MLP columns and vocabulary into whole, equal slices; padded=True:
    the heads only (a trainer that pads the MLP columns and the vocabulary to a multiple of tp, as Megatron-LM)."""
    sizes = [("num_attention_heads", mc.num_attention_heads), ("num_key_value_heads", mc.num_key_value_heads)]
    sizes += [] if padded else [("intermediate_size", mc.intermediate_size), ("vocab_size", mc.vocab_size)]

    def good():  # the fix the sentence offers (made only for a sentence: the planner asks this ~10^5 times a search)
        return "{" + ", ".join(str(d) for d in range(1, min(mc.num_attention_heads, 64) + 1)
                               if all(n % d == 0 for _, n in sizes)) + "}"

    if tp > mc.num_key_value_heads:
        return (f"tp={tp} is more than num_key_value_heads={mc.num_key_value_heads} (every tensor-parallel rank "
                f"needs at least one whole KV head, and KV heads are not replicated); pick tp in {good()} or a model "
                f"with at least {tp} KV heads.")
    for name, n in sizes:
        if n % tp:
            return f"tp={tp} does not divide {name}={n}; pick tp in {good()}."
    return None


# ===================================================================================== context parallelism
def context_parallel_rule(cfg, model_config):
    """Context parallelism's rules: the one-sentence problem with these settings, or None."""
    if cfg.cp == 1:
        return None
    if cfg.seq_len % (2 * cfg.cp):
        good = [c for c in range(1, 65) if cfg.seq_len % (2 * c) == 0][:8]
        fix = f"pick cp in {{{', '.join(map(str, good))}}}, or " if good else ""
        seq = max(2 * cfg.cp, cfg.seq_len // (2 * cfg.cp) * 2 * cfg.cp)  # the nearest multiple of 2*cp below
        return (f"cp={cfg.cp} needs seq_len={cfg.seq_len} divisible by 2*cp={2 * cfg.cp} (each rank holds two of "
                f"2*cp equal chunks of every sequence); {fix}pass --seq-len {seq} (a multiple of {2 * cfg.cp}).")
    heads, tp = model_config.num_attention_heads, cfg.tp
    if cfg.cp_impl == "ulysses" and heads % tp == 0 and (heads // tp) % cfg.cp:  # (tp's own rule: tp divides heads)
        good = [c for c in range(1, heads // tp + 1) if (heads // tp) % c == 0]
        return (f"cp_impl='ulysses' with cp={cfg.cp} needs the query heads per tp rank (num_attention_heads={heads} / "
                f"tp={tp} = {heads // tp}) divisible by cp (each cp rank attends with its share of the heads); pick cp "
                f"in {{{', '.join(map(str, good))}}} or --cp-impl ring.")
    if model_config.attn_impl == "eager":
        return (f"attn_impl='eager' with cp={cfg.cp}: context parallelism computes attention block by block itself "
                f"(the s x s score matrix is never formed whole), so the eager path would never run; drop "
                f"--attn-impl eager.")
    return None


# ==================================================================================== pipeline parallelism
def pipeline_parallel_rule(cfg, model_config):
    """Pipeline parallelism's own rules: the one-sentence problem with these settings, or None (which strategies
    combine with it: `combination_problem`)."""
    if cfg.pp == 1:
        return None
    v = chunks_of(cfg.pp_schedule, cfg.pp_chunks)
    if cfg.pp_chunks > 1 and cfg.pp_schedule != "interleaved":
        return (f"pp_chunks={cfg.pp_chunks} applies to the interleaved schedule only (zb-v and dualpipe always use 2, "
                f"the others 1); pass --pp-schedule interleaved or drop --pp-chunks.")
    if cfg.pp_schedule == "dualpipe":  # p stages, each on two ranks: micro-batches enter at both ends
        if cfg.pp % 2 or cfg.grad_acc % 2 or cfg.grad_acc < 2 * cfg.pp:
            return (f"pp_schedule='dualpipe' needs an even pp and an even grad_acc >= 2*pp (half the micro-batches "
                    f"enter at each end), got pp={cfg.pp}, grad_acc={cfg.grad_acc}; pass an even --pp and --grad-acc "
                    f"{max(2 * cfg.pp, cfg.grad_acc + cfg.grad_acc % 2)}.")
        v = 1  # as many stages as ranks
    if cfg.pp_schedule == "interleaved" and cfg.pp_chunks == 1:
        return ("pp_schedule='interleaved' with pp_chunks=1 is plain 1F1B; pass --pp-chunks 2 (or more) for "
                "interleaving, or --pp-schedule 1f1b.")
    L = model_config.num_hidden_layers
    if cfg.pp * v > L:
        return (f"pp={cfg.pp} with {v} chunk{'s' if v > 1 else ''} per rank needs {cfg.pp * v} stages of at least one "
                f"layer each but the model has num_hidden_layers={L}; pick pp <= {max(1, L // v)}"
                + (" or fewer --pp-chunks." if cfg.pp_schedule == "interleaved" else "."))
    if cfg.pp_schedule == "interleaved" and cfg.grad_acc % cfg.pp:
        return (f"the interleaved schedule needs grad_acc={cfg.grad_acc} (the micro-batches of a step) to be a "
                f"multiple of pp={cfg.pp}; pass --grad-acc {cfg.pp * max(1, cfg.grad_acc // cfg.pp)}.")
    return None


# ====================================================================================== expert parallelism
def expert_parallel_rule(cfg, model_config):
    """Expert parallelism's own rules: the one-sentence problem with these settings, or None (which strategies
    combine with it: `combination_problem`)."""
    ep = cfg.ep
    E = model_config.num_local_experts
    if ep > 1 and not E:
        return (f"ep={ep} needs a model with experts, but this one is dense (num_local_experts=0); add --experts E "
                f"(e.g. 4) or use --preset tiny-moe.")
    if cfg.dp % ep or (E and E % ep):  # the experts are split over ep ranks carved out of the dp ranks
        broken = " and ".join(w for w, bad in ((f"dp={cfg.dp}", cfg.dp % ep), (f"the {E} experts", E and E % ep)) if bad)
        good = [d for d in range(1, cfg.dp + 1) if cfg.dp % d == 0 and (not E or E % d == 0)]
        only = "" if len(good) > 1 else \
            f" (with dp={cfg.dp} only ep=1 fits; e.g. --dp {E} --ep {E} puts the experts on {E} ranks)" if E else ""
        return (f"ep={ep} does not divide {broken} (expert-parallel ranks are carved out of the dp={cfg.dp} "
                f"data-parallel ranks and each holds an equal share of the {E} experts, so ep must divide both); "
                f"pick ep in {{{', '.join(map(str, good))}}}{only}.")
    if E and cfg.cp > 1 and model_config.capacity_factor:
        return (f"capacity_factor={model_config.capacity_factor} with cp={cfg.cp} is not supported (an expert's "
                f"capacity fills in token order along the whole sequence, and cp splits sequences); pass "
                f"--capacity-factor 0 (no-drop routing) or --cp 1.")
    if E and not model_config.routed_scaling_factor > 0:
        return (f"routed_scaling_factor={model_config.routed_scaling_factor} must be positive (it multiplies the "
                f"routed experts' gates); pass --routed-scaling 1 (or DeepSeek-V3's 2.5).")
    if E and model_config.scoring_func not in ("softmax", "sigmoid"):
        return (f"scoring_func={model_config.scoring_func!r} is not a router picotron has; pick softmax (Mixtral) or "
                f"sigmoid (DeepSeek-V3).")
    if E and model_config.num_experts_per_tok > E:
        return (f"top_k={model_config.num_experts_per_tok} is more than the {E} experts; pick top_k between 1 "
                f"and {E}.")
    return None


# ======================================================================================= mixed precision
def precision_rule(cfg, model_config):
    """The precision recipe's own rules: the one-sentence problem with these settings, or None (which strategies
    combine with it: `combination_problem`)."""
    scale = cfg.loss_scale
    if scale not in ("dynamic", "none"):
        try:
            ok = 0 < float(scale) < float("inf")  # NaN compares False
        except ValueError:
            ok = False
        if not ok:
            return (f"loss_scale={scale!r} is neither dynamic, none nor a positive number; pass --loss-scale dynamic "
                    f"(the default) or a number such as 1024.")
    if scale != "dynamic" and cfg.dtype != "fp16":
        return (f"loss_scale={scale!r} only applies with --dtype fp16 ({cfg.dtype} keeps fp32's exponent range, so "
                f"nothing underflows); drop --loss-scale or pass --dtype fp16.")
    return None


# =============================================================================================== kernels
def kernels_rule(cfg, model_config):
    """The kernels' rule for a training run: the one-sentence problem, or None."""
    if cfg.kernels != "triton":
        return None
    import torch  # only --kernels triton asks what this machine runs (picotron.kernels imports triton)
    from picotron.kernels import triton_runs_on
    gpu = cfg.device != "cpu" and torch.cuda.is_available()
    if not triton_runs_on("cuda" if gpu else "cpu"):
        return ("kernels='triton' needs the triton package and a CUDA GPU (or TRITON_INTERPRET=1 on a CPU, slow); "
                "pass --kernels compile or auto, or pip install triton.")
    return None


# each checks its own values: rule(cfg, model_config) -> one sentence or None
RULES = (tensor_parallel_rule, context_parallel_rule, pipeline_parallel_rule, expert_parallel_rule, precision_rule,
         kernels_rule)


# ================================================================================================ traces
def profile_steps(text):
    """--profile's optimizer steps: "A:B" -> (A, B), "A" -> (A, A), both included; None if it is neither."""
    parts = str(text).split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        return None
    first, last = int(parts[0]), int(parts[-1])
    return first, last


def profile_rule(cfg, model_config):
    """--profile (picotron.trace): a range of steps the run takes, first <= last."""
    if cfg.profile is None:
        return None
    steps = profile_steps(cfg.profile)
    if steps is None or not 1 <= steps[0] <= steps[1] <= cfg.steps:
        a, b = (2, 3) if cfg.steps >= 3 else (1, cfg.steps)
        return (f"profile={cfg.profile!r} is not a range of this run's optimizer steps (A:B, both included, with 1 <= "
                f"A <= B <= steps={cfg.steps}; or one step A); pass e.g. --profile {a}:{b} (step 1 pays for warm-up).")
    return None


RULES += (profile_rule,)
# --- end traces


def padded_tp_rule(cfg, model_config):
    """Tensor parallelism's rule for another trainer, which pads the MLP columns and the vocabulary: whole heads."""
    return tp_shape_problem(model_config, cfg.tp, padded=True)


# what the strategies' shapes need (heads, chunks, stages, experts) whoever's trainer runs them: the planner judges
# published runs of other software by these
SHAPE_RULES = (padded_tp_rule, context_parallel_rule, pipeline_parallel_rule, expert_parallel_rule)


# ================================================================================ which strategies combine
def combination_problem(cfg, mc):
    """Which strategies combine: a table of the pairs that do not (or that need each other), each with the
    sentence that refuses it. The first row that applies wins; None when none does. The degrees dp, pp, cp, tp,
    ep with sp and ZeRO-1 otherwise all combine (tests/test_parity_matrix.py trains each pair); ZeRO-2/3 with pp,
    tied embeddings included: tests/test_zero.py."""
    dp, experts = cfg.dp * cfg.cp, mc.is_moe  # dp: the data-parallel ranks, those ZeRO shards over
    table = [  # (this, with that, refused when, the one sentence)
        ("dp_impl=ddp", "collectives=ours", cfg.dp_impl == "ddp" and cfg.collectives == "ours" and dp > 1,
         "dp_impl='ddp' runs torch's DistributedDataParallel, which always uses torch.distributed's own "
         "collectives, but collectives='ours' asks for lesson 02's; drop --dp-impl ddp or --collectives ours."),
        ("zero", "dp_impl", cfg.zero and cfg.dp_impl != "bucket",
         f"dp_impl={cfg.dp_impl!r} does not apply with zero={cfg.zero} (ZeRO replaces the data-parallel wrapper: it "
         f"reduce-scatters the gradients itself); drop --dp-impl or use zero=0."),
        ("zero", "needs dp", cfg.zero and dp == 1,
         f"zero={cfg.zero} with dp=1 has nothing to shard over (ZeRO splits the model states over the data-parallel "
         f"ranks); add --dp 2 or more, or drop --zero."),
        ("dp_shard", "needs zero", cfg.dp_shard and not cfg.zero,
         f"dp_shard={cfg.dp_shard} without --zero has nothing to shard (HSDP shards ZeRO's model states within groups "
         f"of dp_shard ranks and replicates them across the groups); add --zero 1, 2 or 3, or drop --dp-shard."),
        ("dp_shard", "divides dp", cfg.dp_shard and cfg.dp % cfg.dp_shard,
         f"dp_shard={cfg.dp_shard} does not divide dp={cfg.dp} (HSDP cuts the dp ranks into equal groups of dp_shard "
         f"that each hold one sharded copy); pick dp_shard in "
         f"{{{', '.join(str(d) for d in range(1, cfg.dp + 1) if cfg.dp % d == 0)}}}."),
        ("dp_shard", "something to shard", cfg.dp_shard == 1 and cfg.cp == 1 and cfg.zero,
         "dp_shard=1 with cp=1 leaves ZeRO one rank per group, nothing to shard (every rank a full replica: plain "
         "data parallelism); pick dp_shard of 2 or more, or drop --zero and --dp-shard."),
        ("dp_shard", "ep", cfg.dp_shard and cfg.ep > 1,
         f"dp_shard={cfg.dp_shard} with ep={cfg.ep} is not supported yet (the experts' replicas, the edp axis, are not "
         f"cut into shard and replicate groups); drop --dp-shard or use --ep 1."),
        ("async_tp", "needs tp", cfg.async_tp and cfg.tp == 1,
         "--async-tp with tp=1 has no tensor-parallel collective to overlap; add --tp 2 or more with --sp, or drop "
         "--async-tp."),
        ("async_tp", "needs sp", cfg.async_tp and not cfg.sp,
         "--async-tp decomposes sequence parallelism's all-gather and reduce-scatter into ring steps under the matmuls "
         "(without --sp tensor parallelism all-reduces, which has no chunk to start on early; torchtitan and Megatron "
         "also require it); add --sp, or drop --async-tp."),
        ("ep_overlap", "needs ep", cfg.ep_overlap and cfg.ep == 1,
         "--ep-overlap with ep=1 has no all-to-all to overlap (every expert is on this rank); add --ep 2 or more "
         "(with a mixture-of-experts model), or drop --ep-overlap."),
        ("sp", "needs tp", cfg.sp and cfg.tp == 1,
         "--sp with tp=1 does nothing (sequence parallelism splits what tensor parallelism leaves replicated over "
         "the tp ranks); add --tp 2 or more, or drop --sp."),
        ("dp_impl=ddp", "pp", cfg.pp > 1 and cfg.dp_impl == "ddp",
         f"dp_impl='ddp' with pp={cfg.pp} is not supported (DDP needs each forward followed by its backward, a "
         f"pipeline interleaves micro-batches); use --dp-impl bucket."),
        ("zero", "dualpipe", cfg.zero and cfg.pp > 1 and cfg.pp_schedule == "dualpipe",
         f"zero={cfg.zero} with pp_schedule='dualpipe' is not supported (the two copies of a stage would sum gradient "
         f"shards cut at different places); drop --zero or pick another --pp-schedule."),
        ("experts", "dualpipe", experts and cfg.pp > 1 and cfg.pp_schedule == "dualpipe",
         "experts with pp_schedule='dualpipe' are not supported yet (the two copies of each stage's experts and their "
         "routing statistics have no parity test); use --pp-schedule zb-v or 1f1b."),
        ("experts", "zero=3", experts and cfg.zero == 3,
         "experts with zero=3 are not supported yet; use --zero 1 or 2."),
        ("ep", "dp_impl=ddp", cfg.ep > 1 and cfg.dp_impl == "ddp",
         "ep with dp_impl='ddp' is not supported (torch's DDP averages every gradient over one group, but experts "
         "are summed over their own replicas); drop --dp-impl ddp."),
        ("dtype=fp8", "pp zero-bubble",
         cfg.dtype == "fp8" and cfg.pp_schedule in ("zb-h1", "zb-v", "dualpipe") and cfg.pp > 1,
         f"dtype='fp8' with pp_schedule={cfg.pp_schedule!r} is not supported (both replace the linears' matmul: the "
         f"split backward would drop FP8); use --pp-schedule 1f1b or interleaved, or --dtype bf16."),
        # --- async TP (picotron/async_tp.py): its collective matmuls multiply with F.linear's arithmetic themselves
        # (the zero-bubble split backward works: they hand their weight gradients to its store)
        # --- fine-grained FP8 (picotron/fp8_blockwise.py)
        ("fp8_recipe", "needs dtype=fp8", cfg.fp8_recipe != "tensor" and cfg.dtype != "fp8",
         f"--fp8-recipe {cfg.fp8_recipe} with dtype={cfg.dtype!r} does nothing (the recipe chooses FP8's scales); add "
         f"--dtype fp8, or drop --fp8-recipe."),
        # --- end fine-grained FP8
        ("async_tp", "dtype=fp8", cfg.async_tp and cfg.dtype == "fp8",
         "--async-tp with dtype='fp8' is not supported yet (the collective matmul multiplies each arriving chunk "
         "itself, in the recipe's autocast precision, not through FP8's matmul); use --dtype bf16, or drop --async-tp."),
        # --- end async TP
        # --- Muon (picotron/muon.py): how a sharded matrix meets for Newton–Schulz
        ("muon_impl=owner", "needs muon", cfg.muon_impl == "owner" and cfg.optimizer != "muon",
         "--muon-impl owner says how Muon's sharded matrices meet, but the optimizer is "
         f"{cfg.optimizer!r}; add --optimizer muon, or drop --muon-impl."),
        ("muon_impl=owner", "zero and tp", cfg.optimizer == "muon" and cfg.muon_impl == "owner" and cfg.zero
         and cfg.tp > 1,
         f"--muon-impl owner with zero={cfg.zero} and tp={cfg.tp} is not supported (the owner reassembles a matrix "
         f"over one axis, but these matrices are cut over tp and ZeRO both); use --muon-impl gather."),
        # --- end Muon
        ("dtype=fp16", "experts", cfg.dtype == "fp16" and experts,
         "dtype='fp16' with experts is not supported (the load-balancing loss reaches the router outside the scaled "
         "loss, so its gradient would miss the loss scale); use --dtype bf16-params or bf16."),
    ]
    return next((sentence for _, _, refused, sentence in table if refused), None)


# ========================================================================================= all of them
def layout_problem(cfg, mc, trainer=True):
    """The first broken rule of a layout's settings, or None, without config.check or the inputs: with `trainer`,
    every rule `validate` applies to the strategies (RULES, then combination_problem), in its order; without, only
    SHAPE_RULES: what another trainer of the same strategies faces too. The planner asks this, so it keeps no copy
    of any rule."""
    for rule in (RULES + (combination_problem,)) if trainer else SHAPE_RULES:
        problem = rule(cfg, mc)
        if problem:
            return problem
    return None


def validate(cfg, world_size=None, any_world_size=False, per_node=None):
    """Raise ConfigError for the first broken rule, in one sentence, before any process group exists.
    `world_size`: the processes the launcher started (default 1: a process on its own); `per_node`: those on this
    machine (default: all of them). any_world_size=True: the processes are not started yet, the caller will start
    cfg.world_size of them, cfg.nnodes machines' worth. The caller reads the launcher's numbers (launch.place) and
    passes them: this module reads no environment."""
    if world_size is None:
        world_size = cfg.world_size if any_world_size else 1
    mc = config.check(cfg)  # the settings themselves: names, ranges, the model's shape, faults, nodes
    problem = layout_problem(cfg, mc)
    if problem:
        raise ConfigError(problem)
    _check_inputs(cfg, mc)
    # cuda + nccl with one GPU per process of this node, or cpu + gloo; never one for the other in silence
    local = cfg.world_size // cfg.nnodes if any_world_size else per_node or world_size
    problem = device_problem(local, cfg.device)
    if problem:
        raise ConfigError(problem)
    if world_size != cfg.world_size:
        raise ConfigError(
            f"world size {world_size} does not equal dp*pp*cp*tp = {cfg.dp}*{cfg.pp}*{cfg.cp}*{cfg.tp} = "
            f"{cfg.world_size}; launch {cfg.world_size} process{'es' if cfg.world_size > 1 else ''} "
            f"(torchrun --nproc_per_node {cfg.world_size} -m picotron.train ...) or change the degrees.")


def _check_inputs(cfg, mc):
    """The data, the tokenizer and the checkpoint to resume from: read now, so a wrong one costs a second."""
    try:
        if cfg.tokenizer == "byte":
            vocab = 256  # picotron.data.ByteTokenizer: the UTF-8 bytes, nothing to load
        else:  # a local folder or the Hub: transformers (and torch) load now
            from picotron import data
            vocab = data.get_tokenizer(cfg.tokenizer).vocab_size
        if vocab > mc.vocab_size:
            raise ConfigError(f"tokenizer {cfg.tokenizer!r} has {vocab} ids but vocab_size={mc.vocab_size}; pass "
                              f"--vocab-size {vocab} or a smaller tokenizer.")
        if cfg.data != "shakespeare" and not cfg.data.startswith("hf:"):  # a local file: read it now
            content = text.load_text(cfg.data)  # (another tokenizer's count waits for the trainer: no tokenizing twice)
            if cfg.tokenizer == "byte":
                text.check_size(cfg.data, len(content.encode("utf-8")), cfg.seq_len)
        problem = runs.resume_problem(cfg) if cfg.resume else None
    except text.DataError as e:
        raise ConfigError(str(e)) from None
    if problem:
        raise ConfigError(problem)


def device_problem(local_world, device=None):
    """Why `local_world` processes on this node cannot run on `device` ("auto", "cpu", "cuda"), in one sentence,
    or None. The rule: cuda + nccl when there is one GPU per local process; cpu + gloo when asked or when torch
    sees no GPU; never silently one for the other. Calls no torch.cuda function for device="cpu", and imports
    torch only to count GPUs (one process on auto always fits: its GPU, or the CPU)."""
    if device == "cpu":
        return None
    if device not in (None, "auto", "cuda"):
        return f"device={device!r} is not one of 'auto', 'cpu', 'cuda'; pass --device auto, cpu or cuda."
    if device != "cuda" and local_world <= 1:
        return None
    import torch  # counting the GPUs takes torch (and its CUDA runtime)
    if not torch.cuda.is_available():  # auto: gloo on a machine without GPUs
        return "device='cuda' but no CUDA GPU is visible to torch; pass --device auto or --device cpu." \
            if device == "cuda" else None
    gpus = torch.cuda.device_count()
    if gpus >= local_world:
        return None
    asked = "--device cuda with " if device == "cuda" else ""
    procs = f"{local_world} process{'es' if local_world > 1 else ''} per node"
    return (f"{asked}{procs} need{'s' if asked else ''} {local_world} GPUs (one each); this node has {gpus}: pass "
            f"--device cpu to run them on CPU with gloo, or run at most {gpus} process{'es' if gpus > 1 else ''} "
            f"per node.")
