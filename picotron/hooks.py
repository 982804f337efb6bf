"""Where measurement plugs into the algorithms: they name their phases, whoever measures listens.

The strategies never count or time anything themselves (they import neither `picotron.metrics` nor a recorder).
An object with phases worth seeing (a pipeline's forward of one micro-batch, a ring-attention step, ZeRO-3's
gather of one unit) holds a `Phases` and wraps each phase in it:

    self.phases = Phases()                             # in the algorithm, once
    with self.phases("forward", micro=i, chunk=c):     # around the work; a no-op while nobody listens
        ...

A lesson, a benchmark or the trainer installs a listener: a function (name, **info) -> context manager, entered
around the phase. `metrics.Timeline.record` is one (the phase becomes an event of a per-rank timeline), a counter
of the bytes autograd saves is another (`metrics.ActivationCounter`):

    attention.phases.listen(timeline.record)           # every phase becomes an event
    watch(model, listener=timeline.record)             # the same for every Phases in a module tree

Communication needs no phases: every collective goes through the mesh's axes, and an axis given a recorder
(`Mesh.recorded`, `metrics.Recorder`) counts and times it there.
"""
from contextlib import ExitStack, nullcontext


class Phases:
    """The named phases of one algorithm object, and the listeners that measure them."""

    def __init__(self):
        self.listeners = []

    def listen(self, listener):
        """Enter `listener(name, **info)` (a context manager) around every phase from now on; returns it."""
        self.listeners.append(listener)
        return listener

    def forget(self, listener=None):
        """Stop calling `listener` (every listener when None)."""
        self.listeners = [] if listener is None else [f for f in self.listeners if f is not listener]

    def __call__(self, name, **info):
        if not self.listeners:
            return nullcontext()
        if len(self.listeners) == 1:
            return self.listeners[0](name, **info)
        stack = ExitStack()
        for listener in self.listeners:
            stack.enter_context(listener(name, **info))
        return stack


def phases_in(*objects):
    """Every `Phases` held by these objects or, for modules, by any of their submodules (each once)."""
    found, seen = [], set()
    for obj in objects:
        members = obj.modules() if hasattr(obj, "modules") else [obj]
        for m in members:
            ph = getattr(m, "phases", None)
            if isinstance(ph, Phases) and id(ph) not in seen:
                seen.add(id(ph))
                found.append(ph)
    return found


def watch(*objects, listener):
    """Install `listener` on every Phases in `objects` (modules are searched); returns how many it reached."""
    found = phases_in(*objects)
    for ph in found:
        ph.listen(listener)
    return len(found)
