"""Pipeline parallelism: the layers cut into stages, one per rank, micro-batches flowing through them
(GPipe: Huang et al. 2019; 1F1B with a flush: Narayanan et al. 2021 "PipeDream-Flush", arXiv:2006.09503, Megatron-LM 2021 for the interleaved
schedule; zero bubble: Qi et al. 2024, "Zero Bubble Pipeline Parallelism"; DualPipe: DeepSeek-V3 technical
report, 2024, section 3.2.1).

Stage s keeps layers [a_s, b_s); stage 0 also keeps the embedding, the last stage the final norm and the LM
head. A micro-batch's forward goes stage 0 -> 1 -> ... -> p-1 (each stage sends its output activation to the
next, [b, s, h]); its backward comes back (each stage sends the gradient of its input to the previous one).
A stage waiting for its neighbour is idle: the *bubble*.

The schedules (AFAB, 1F1B, interleaved, ZB-H1, ZB-V, DualPipe) are data, each rank's ordered list of F, B and
W actions, built, simulated and costed in picotron.pipeline_schedules (pure Python, no torch); the split
schedules' B and W come from picotron.zero_bubble. This module runs them on real processes:

    keep_stage / mark_stage   this rank's chunks of the model (`PipelineStage`), cut by pipeline_schedules.split_layers
    Pipeline                  the step engine: walks this rank's actions and messages in the one order every rank
                              follows (pipeline_schedules.with_messages; each message one batch on the group of
                              its two ranks: NCCL-safe by construction), syncs the tied embeddings, hands the loss
                              to every rank; with one stage it is plain gradient accumulation
    PipelineSampler           text generation through the stages

DualPipe holds every stage twice: rank r's chunk 0 is stage r, its chunk 1 a copy of stage p-1-r for the
micro-batches that enter at the last rank. The copies start equal (the init is by parameter name), their
gradients are summed after the step's backward (`sum_copies`: one exchange between ranks r and p-1-r), so they
take the same step; the loss is summed over the two last stages (ranks p-1 and 0). Chunk 1's parameters are
placed as copies (`copy_of`): clipping counts them once, a checkpoint saves chunk 0's and loads both.

The executor measures nothing: it names each action as a phase (`Pipeline.phases`, picotron.hooks: "forward",
"backward", "weight", with the micro-batch, chunk and stage), and whoever measures listens (a timeline, the
activations it saves: metrics.ActivationPeak).
"""
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from picotron import hooks, marks, p2p
from picotron.model import Stages, init_tensor
from picotron.pipeline_schedules import Message, split_layers, with_messages
# check(cfg, model_config), this strategy's rule, lives in picotron.rules: no torch there, so a refusal is instant
from picotron.rules import pipeline_parallel_rule as check


# ========================================================================================= a rank's stage
class PipelineStage(nn.Module):
    """This rank's chunks of the model: `chunks[c]` is a Llama keeping only stage schedule.stage(rank, c)'s
    layers (with the embedding on stage 0, norm and head on the last). Parameter names inside a chunk are
    the full model's (layers.5.mlp..., lm_head.weight), so the layout-independent init holds.

    `stages()` is what gradient wrappers and the executor read (model.Stages, the same contract a whole Llama
    answers): the chunks, their stage ids, and the names of this rank's ends of a tied embedding (`mark_stage`)."""

    def __init__(self, chunks, stages):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stage_ids = list(stages)
        self.tied = ()  # names of this rank's first-stage embedding and last-stage head copy, when tied (mark_stage)
        self.config = chunks[0].config

    def stages(self):
        return Stages(chunks=tuple(self.chunks), ids=tuple(self.stage_ids), tied=tuple(self.tied))

    def to_empty(self, *, device, recurse=True):
        """torch's to_empty, then every parameter given its placement again (picotron.marks)."""
        super().to_empty(device=device, recurse=recurse)
        return marks.attach(self)

    def init_weights(self, seed):
        for chunk in self.chunks:
            chunk.init_weights(seed)
        placed = marks.records(self)
        for name in self.tied:  # the last stage's copy of the tied matrix starts as the embedding
            if name.endswith("lm_head.weight"):
                head, where = self.get_parameter(name), placed[name]
                full = init_tensor("embed_tokens.weight", where.shape, seed, self.config.initializer_range)
                with torch.no_grad():
                    head.copy_(where.take(full, head.shape))
        return self

    @property
    def recompute(self):
        return self.chunks[0].recompute

    @recompute.setter
    def recompute(self, value):
        for chunk in self.chunks:
            chunk.recompute = value


def keep_stage(model_factory, schedule, rank, model_config, seq_len):
    """Build this rank's PipelineStage (on the meta device): for each chunk a fresh `model_factory()` with
    the layers of its stage kept and the rest dropped; embedding only on stage 0, norm + head on the last."""
    cuts = split_layers(model_config, schedule.stages, seq_len)
    last = schedule.stages - 1
    chunks, stages = [], []
    for c in range(schedule.v):
        s = schedule.stage(rank, c)
        model = model_factory()
        lo, hi = cuts[s]
        for i in list(model.layers.indices()):
            if not lo <= i < hi:
                del model.layers[str(i)]
        if s != 0:
            model.embed_tokens = None
        if s != last:
            model.norm = model.lm_head = None
        elif model_config.tie_word_embeddings and s != 0:  # its own copy of the matrix, kept equal by sync
            model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))  # (lm_head keeps its record)
        chunks.append(model)
        stages.append(s)
    return PipelineStage(chunks, stages)


def mark_stage(stage, schedule, pp):
    """After materialising: place every parameter as sharded over pp (each stage holds different ones), the
    last stage's copy of a tied embedding as a copy (clipping counts it once, on stage 0), and remember the
    tied pair for the gradient sync. DualPipe: chunk 1 is a copy of another rank's chunk 0, each of its
    parameters placed as a copy of itself (of the embedding for a tied head, as on the last stage)."""
    tied = []
    for c, (chunk, s) in enumerate(zip(stage.chunks, stage.stage_ids)):
        for name, _ in chunk.named_parameters():
            marks.place(chunk, name, dims=pp.dims)
            if schedule.copies and c == 1:
                marks.place(chunk, name, copy_of=name)
        if s == 0 and chunk.embed_tokens is not None and chunk.lm_head is None:
            tied.append(f"chunks.{c}.embed_tokens.weight")
        if s == schedule.stages - 1 and chunk.embed_tokens is None and stage.config.tie_word_embeddings:
            tied.append(f"chunks.{c}.lm_head.weight")
            marks.place(chunk, "lm_head.weight", copy_of="embed_tokens.weight")  # (a DualPipe copy of it too)
    if stage.config.tie_word_embeddings and schedule.stages > 1:
        stage.tied = tuple(tied)
    return stage


def sync_tied(grads, ends):
    """Tied embeddings on two stages: add the gradients of the first stage's embedding and the last stage's
    head, so both copies take the same step from the same values. `grads`: what this rank holds of the two
    (the wrapper's `tied_grads()`: whole gradients, or under ZeRO this rank's shards of them, which line up):
    both, added in memory (one rank holds both ends, as in the V shape), or one, all-reduced over `ends` (the
    two ranks that hold the ends)."""
    if len(grads) == 2:
        grads[0].add_(grads[1])
        grads[1].copy_(grads[0])
        return
    for g in grads:
        ends.all_reduce(g, label="tied embedding")


def sum_copies(chunks, pp):
    """DualPipe: rank r's chunk 0 (stage r) is a copy of its mirror's (rank p-1-r) chunk 1, and its chunk 1 of the
    mirror's chunk 0. Each sends the other its gradients, chunk 0's then chunk 1's, as one flat message
    (one batch of a send and a receive on the pp group, posted at the same point of the step by every rank:
    NCCL-safe), and adds the mirror's copy of each stage to its own: both hold the same sum, bit for bit
    (a + b = b + a in floating point), so the copies take the same step."""
    mine = [[p.grad for p in chunk.parameters()] for chunk in chunks]
    flat = [torch.cat([g.reshape(-1) for g in grads]) for grads in mine]
    out = torch.cat(flat)
    theirs = torch.empty_like(out)
    peer = pp.ranks[pp.size - 1 - pp.rank]
    p2p.wait_all(pp.exchange([("send", out, peer), ("recv", theirs, peer)], label="DualPipe copies"))
    theirs = theirs.split([flat[1].numel(), flat[0].numel()])  # the mirror's chunk 0 is my chunk 1's stage
    for grads, add in zip(mine, reversed(theirs)):
        for g, piece in zip(grads, add.split([g.numel() for g in grads])):
            g.add_(piece.view_as(g))


# ============================================================================================= executor
class Pipeline:
    """Runs a `Schedule` for one optimizer step: the step engine of a pipeline stage (the same contract as
    `schedule.OneStage`: gradients left synchronised, the global-batch loss returned on every rank).

    Each rank walks its action list. F: the input is the batch's tokens on stage 0, else the activation
    received from the previous stage; the output goes to the next stage (or, on the last, into the loss,
    divided by m). B: the output gradient arrives from the next stage (the loss on the last); the input's
    gradient goes back. W: the stashed weight gradients. Between chunks of one rank (the V's turn) the tensor is
    handed over in memory.

    Messages, and why they cannot hang on NCCL. There a send or a receive blocks its stream until the partner's
    runs, and NCCL asks that operations on all communicators be submitted in one order on every rank (a GPU may
    run one NCCL kernel at a time). Posting "receive B0" ahead of "send F1" while the neighbour first needs F1
    waits forever. So the messages are data too: `pipeline_schedules.with_messages` puts each rank's sends and
    receives between its actions in the order of the schedule's ideal timeline, one order that every rank's list
    is a piece of; this executor posts them exactly there. A receive is posted as early as that order allows (right
    after this rank's previous message: it arrives while this rank computes) and waited for just before the action
    that needs it; a send is posted right after the action that made it, waited for at the end of the step.
    Each message is one `batch_isend_irecv` (picotron.p2p) on the group of its two ranks (`mesh.pp_links`, made
    with the mesh), so no host waits at a first contact either. tests/test_nccl_rules.py
    replays every schedule at pp 2 and 4, and with ZeRO, tp and dp, under these rules."""

    def __init__(self, schedule, mesh, hidden, seq_div=1, ends=None, autocast=nullcontext, store=None,
                 dtype=torch.float32):
        self.schedule, self.mesh, self.pp = schedule, mesh, mesh.pp
        self.dtype = dtype  # of the residual stream that travels: the parameters' (fp32, or bf16/fp16 parameters)
        self.hidden, self.seq_div = hidden, seq_div  # an activation is [b, s / seq_div, hidden] (sp: seq_div = tp)
        self.ends, self.autocast, self.store = ends, autocast, store  # store: a split schedule's WeightGradStore
        self.phases = hooks.Phases()  # each action, for whoever measures
        self.rank = mesh.pp.rank
        self.last_stage = schedule.stages - 1
        self.steps = with_messages(schedule)[self.rank]  # this rank's actions and messages, in the one order
        self.final = set()  # the actions after which a chunk's parameters have their whole gradient (last B, W)
        for c in range(schedule.v):
            for kind in ("B", "W"):
                same = [a for a in schedule.ranks[self.rank] if a.kind == kind and a.chunk == c]
                if same:
                    self.final.add(same[-1])

    # ------------------------------------------------------------------------------- messages
    def _post(self, msg):
        """Post message `msg` (a pipeline_schedules.Message): a receive into a fresh buffer, kept until its action;
        a send of what this rank's action left in the outbox."""
        key = (msg.kind, msg.mb, msg.chunk)
        if msg.op == "recv":
            buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.mesh.device)
            self.pending[key] = (buf, self._message("recv", buf, msg.peer))
        else:
            label = "activation" if msg.kind == "F" else "gradient"
            self.sends += self._message("send", self.outbox.pop(key), msg.peer, label)

    def _receive(self, a):
        """Action a's input from its neighbour: handed over in memory by this rank's other chunk, or the buffer of
        the receive posted earlier, waited for now."""
        key = (a.kind, a.mb, a.chunk)
        if key in self.local:
            return self.local.pop(key)
        buf, works = self.pending.pop(key)
        p2p.wait_all(works)
        return buf

    def _send(self, t, a, to_stage):
        """What action `a` sends to stage `to_stage`: in memory if this rank holds it, else into the outbox, for
        the send that follows in the list."""
        r, c = self.schedule.where(to_stage, a.mb)
        t = t.detach().to(self.dtype).contiguous()
        if r == self.rank:
            self.local[(a.kind, a.mb, c)] = t
        else:
            self.outbox[(a.kind, a.mb, a.chunk)] = t

    def _message(self, kind, t, peer, label="send"):
        """Post one message to / from pipeline rank `peer` on the group of the two ranks (mesh.pp_links); the
        handles. A recorder on the mesh counts what is sent, under `label` (Axis.exchange)."""
        me, other = self.pp.ranks[self.rank], self.pp.ranks[peer]
        return self.mesh.pp_links[min(me, other), max(me, other)].exchange([(kind, t, other)], label)

    # -------------------------------------------------------------------------------- the step
    def run(self, model, micro_batches, loss_fn):
        """One optimizer step: this rank's actions in order, each named as a phase; then the gradients'
        sync finished, DualPipe's copies' gradients summed, the tied embeddings' gradients summed, and the
        step's loss on every rank."""
        sch = self.schedule
        if len(micro_batches) != sch.m:
            raise ValueError(f"the schedule is for {sch.m} micro-batches, the step has {len(micro_batches)}.")
        self._start(micro_batches)
        chunks = model.stages.chunks  # what the wrapper says the stage holds (model.Stages)
        for a in self.steps:
            if isinstance(a, Message):  # a send or a receive, where the one order puts it
                self._post(a)
                continue
            s = sch.stage(self.rank, a.chunk)
            with self._phase(a, s):
                if a.kind == "F":
                    self._forward(a, s, chunks[a.chunk], micro_batches[a.mb], loss_fn)
                else:  # the chunk's last B (or W) lets the gradient sync of its parameters start
                    with nullcontext() if a in self.final else model.no_sync():
                        if a.kind == "B":
                            self._backward(a, s)
                        else:  # W: the weight gradients this micro-batch's B left in the store
                            self.store.flush((a.mb, a.chunk))
        self._wait_sends()
        model.finish_sync()
        if sch.copies:  # DualPipe: this rank's two chunks and its mirror rank's are the same two stages
            sum_copies(chunks, self.pp)
        if self.ends is not None:  # tied embeddings: the first stage's and the last stage's copy
            sync_tied(model.tied_grads(), self.ends)
        return self._step_loss()

    def _start(self, micro_batches):
        b, seq = micro_batches[0][0].shape
        self.act_shape = (b, seq // self.seq_div, self.hidden)  # every message's
        self.pending, self.outbox, self.local, self.sends = {}, {}, {}, []  # (kind, mb, chunk) -> tensor or receive
        self.saved = {}  # (mb, chunk) -> (input, output) of its forward, until its B
        self.total = torch.zeros((), device=self.mesh.device)  # the loss (on the last stage)

    def _phase(self, a, s):
        """Action `a` as a phase (picotron.hooks): forward, backward or weight of micro-batch a.mb on chunk a.chunk
        (stage s); a backward says whether it also computes the weight gradients (not in a split schedule)."""
        info = dict(micro=a.mb, chunk=a.chunk, stage=s)
        if a.kind == "B":
            info["weights"] = not self.schedule.split
        return self.phases({"F": "forward", "B": "backward", "W": "weight"}[a.kind], **info)

    def _forward(self, a, s, chunk, batch, loss_fn):
        """F: the tokens (stage 0) or the received activation through the chunk; the output on to the next
        stage, or on the last into the loss, divided by m (the step's gradient is that of the mean)."""
        x_ids, y, positions = self._on_device(batch)
        x = x_ids if s == 0 else self._receive(a).requires_grad_()
        with self.autocast():
            out = chunk(x, positions)
            if s == self.last_stage:
                out = loss_fn(out, y) / self.schedule.m
        if s == self.last_stage:
            self.total += out.detach()
        else:
            self._send(out, a, s + 1)
        self.saved[(a.mb, a.chunk)] = (x if s > 0 else None, out)

    def _backward(self, a, s):
        """B: the output gradient (the loss's own on the last stage) back through the chunk, the input's gradient
        to the previous stage. In a split schedule the weight gradients wait in the store for the W."""
        x, out = self.saved.pop((a.mb, a.chunk))
        grad = None if s == self.last_stage else self._receive(a)
        if self.store is not None:
            self.store.deferring = True
        torch.autograd.backward(out, grad)
        if self.store is not None:
            self.store.deferring = False
            self.store.collect((a.mb, a.chunk))
        if s > 0:
            self._send(x.grad, a, s - 1)

    def _wait_sends(self):
        for w in self.sends:
            w.wait()
        self.sends = []

    def _step_loss(self):
        """The loss lives on the last stage: hand it to every stage, then average over the replicas."""
        if self.schedule.copies:  # two last stages (ranks p-1 and 0), each with its direction's losses
            loss = self.total.detach().clone()
            self.pp.all_reduce(loss, label="loss")
        else:
            loss = self.total if self.pp.size == 1 else _from_last(self.total, self.pp, self.schedule)
        return self.mesh.dp_cp.mean(loss)

    def _on_device(self, batch):
        """(inputs, targets, positions) on the device; positions 0..s-1 when the batch has none (a stage
        after the first sees hidden states, whose length under sp is not the sequence's)."""
        x, y, positions = _triple(batch)
        if positions is None:
            positions = torch.arange(x.shape[1])
        dev = self.mesh.device
        return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True), positions.to(dev, non_blocking=True)

    # ----------------------------------------------------------------------------- forward only
    @torch.no_grad()
    def forward_only(self, stage, batch, head=None):
        """One batch through every stage in order (no schedule: evaluation and text generation). Returns
        the last stage's output (or head(output)) on the last rank, None elsewhere."""
        x_ids, _, positions = self._on_device(batch)
        sch = self.schedule
        shape = (x_ids.shape[0], x_ids.shape[1] // self.seq_div, self.hidden)
        x, out = x_ids, None
        for s in range(sch.stages):
            r, c = sch.where(s)
            if r == self.rank:
                if s > 0:
                    prev, _ = sch.where(s - 1)
                    if prev != self.rank:
                        x = torch.empty(shape, dtype=self.dtype, device=self.mesh.device)
                        p2p.wait_all(self._message("recv", x, prev))
                with self.autocast():
                    x = stage.chunks[c](x, positions)
                if s == self.last_stage:
                    out = head(x) if head is not None else x
                else:
                    nxt, _ = sch.where(s + 1)
                    if nxt != self.rank:
                        p2p.wait_all(self._message("send", x.to(self.dtype).contiguous(), nxt))
        return out

    @torch.no_grad()
    def evaluate(self, model, batches, loss_fn):
        """The mean loss over `batches`, forward only through the pipeline; the same number on every rank.
        `model`: this rank's PipelineStage (run.raw)."""
        stage = model
        stage.eval()
        losses = []
        for batch in batches:
            _, y, _ = _triple(batch)
            out = self.forward_only(stage, batch, head=lambda z: loss_fn(z, y.to(z.device)))
            t = torch.zeros((), device=self.mesh.device) if out is None else out.float()
            losses.append(self.mesh.cp.mean(_from_last(t, self.pp, self.schedule)).item())  # cp: tokens split
        stage.train()
        return sum(losses) / len(losses)


def _triple(batch):
    x, y, *positions = batch
    return x, y, (positions[0] if positions else None)


def _from_last(t, pp, schedule):
    """`t` as the rank holding the last stage has it, on every rank of the pp axis."""
    t = t.detach().clone()
    if pp.size > 1:
        pp.broadcast(t, index=schedule.where(schedule.stages - 1)[0])
    return t


class PipelineSampler(nn.Module):
    """ids -> logits over the whole vocabulary on every rank, through the pipeline (text generation).
    `head(x)` turns the last stage's output into full-vocabulary logits (a tp gather, or nothing)."""

    def __init__(self, stage, pipeline, head=None):
        super().__init__()
        self.stage, self.pipeline, self.head = stage, pipeline, head
        self.config = stage.config

    def forward(self, ids):
        s, n = ids.shape[1], self.pipeline.seq_div
        if s % n:  # sequence parallel: pad on the right to a multiple of tp (causal: earlier logits unchanged)
            ids = F.pad(ids, (0, n - s % n))
        out = self.pipeline.forward_only(self.stage, (ids, ids), head=self.head)
        t = out.float() if out is not None else torch.zeros(ids.shape + (self.config.vocab_size,), device=ids.device)
        return _from_last(t, self.pipeline.pp, self.pipeline.schedule)[:, :s]
