"""The figure helpers several lessons draw with (each lesson's own figures stay in its experiment.py).

    FONT                        the smallest text on any figure (tick labels, legends, notes)
    legend_below(ax, ...)       an axes' legend under it, in columns, where it never covers data
    stacked_bar(ax, x, parts, colors, ...)   one bar of {part: height} stacked bottom-up (memory by part, time by phase)
    plot_parity(pairs, ...)     two panels: each run's loss curve over the one-process reference, and their relative
                                difference against the course's parity standard (docs/reference.md#parity-standard)
    plot_parity_below(...)      the same figure, 10 inches wide, each panel's legend under it

matplotlib is imported inside the functions that draw, so an experiment's rank processes that only measure never
load it.
"""
from _common import DRIFT_BOUND, PARITY_STEPS, PARITY_TOL, rel_diffs

FONT = 8  # the smallest text on any figure


def legend_below(ax, ncol=3, dy=-0.2, **kw):
    """Draws `ax`'s legend under the axes (its top `dy` axes-heights below them), `ncol` entries a row, frameless:
    it never covers data. **kw goes to ax.legend (handles=, labels=, ...)."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, dy), ncol=ncol, fontsize=FONT, frameon=False, **kw)


def stacked_bar(ax, x, parts, colors, width=0.8, hatch=None, label=True, **kw):
    """Draws one bar at `x` made of {part: height} stacked bottom-up in the dict's order (memory by part, time by
    phase), each part in colors[part] (grey where `colors` has none) with white edges, `hatch`ed if given (a formula
    beside a measurement); labels the parts for the legend when `label`. **kw goes to ax.bar. Returns the bar's top."""
    bottom = 0
    for k, v in parts.items():
        ax.bar(x, v, width, bottom=bottom, color=colors.get(k, "0.65"), hatch=hatch, label=k if label else None,
               **{"edgecolor": "white", **kw})
        bottom += v
    return bottom


def plot_parity(pairs, what="each run", window=PARITY_STEPS):
    """pairs: {label: (losses, reference losses)}: both curves, and their relative difference against the
    course's parity standard (1e-5 over the first `window` steps, shaded) and, after it, the drift bound."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
    longest = 0
    for label, (got, ref) in pairs.items():
        steps = range(1, len(got) + 1)
        longest = max(longest, len(got))
        ax1.plot(steps, ref, "k-", lw=3, alpha=0.3)
        ax1.plot(steps, got, "o--", ms=3, label=label)
        ax2.semilogy(steps, [max(x, 1e-9) for x in rel_diffs(got, ref)], "o-", ms=3, label=label)
    ax1.set(xlabel="step", ylabel="loss", title=f"{what} (dashed) over one process (grey)")
    ax1.legend(fontsize=7)
    ax2.axvspan(0.5, min(window, longest) + 0.5, color="#55a868", alpha=0.12, lw=0,
                label=f"parity window: steps 1-{window}")
    ax2.axhline(PARITY_TOL, color="#c44e52", ls="--", lw=1, label=f"parity standard {PARITY_TOL:.0e}")
    if longest > window:
        ax2.hlines(DRIFT_BOUND, window + 0.5, longest + 0.5, color="#8172b2", ls=":", lw=1.5,
                   label=f"drift bound after step {window}: {DRIFT_BOUND:.0e}")
    ax2.set(xlabel="step", ylabel="|Δloss| / loss", title="relative difference (1e-9: equal)", ylim=(1e-10, 1e-2))
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_parity_below(pairs, what, height=4.4, diff_ylim=None):
    """plot_parity 10 inches wide and `height` tall, each panel's legend under it, where it cannot cover a curve.
    diff_ylim: the right panel's range, for a lesson that shows a run leaving the parity range on purpose."""
    fig = plot_parity(pairs, what=what)
    fig.set_size_inches(10, height)
    if diff_ylim:
        fig.axes[1].set_ylim(*diff_ylim)
    for ax in fig.axes:
        legend_below(ax, ncol=2)
    fig.tight_layout()
    return fig
