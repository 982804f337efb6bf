"""Find a layout: `python -m picotron.plan --preset llama3-8b --gpus 64 --gpu h100-80gb --seq-len 8192 --global-batch-tokens 4M`.

The Ultra-Scale Playbook's procedure, as a program: (1) fit in memory, (2) reach the global batch, (3) among what
remains, take the fastest. picotron.planner counts the bytes of a layout; this package adds, a module each:

    hardware     `Hardware` and the `GPUS` table (datasheet peaks and links, with sources); the HEADROOM a plan
                 keeps free of each GPU's memory (`usable`)
    time_model   `step_time`: the seconds of one optimizer step by part, from an α-β model of every strategy's
                 collectives, the pipeline's bubble and the overlap each strategy allows
    search       `search`: every layout of a job ranked by predicted tokens/s, each rejected one with its reason (what
                 picotron's trainer refuses, in picotron.rules' sentence); when none fits, `least_memory`,
                 `fewest_gpus` and `bounding`
    published    `PUBLISHED`: large runs whose layout and throughput were published, evaluated by the same model
    cli          the command line, `main` (`python -m picotron.plan` runs it)

Each imports only those above it in this list. docs/reference.md#finding-a-layout-the-planner has the derivations
and the published runs with their sources.
"""
from picotron.plan.hardware import EFFICIENCY, GPUS, HEADROOM, GiB, Hardware, MiB, cpu_hardware, usable  # noqa: F401
from picotron.plan.time_model import busiest_share, dualpipe_bubble, link, ring_time, step_time  # noqa: F401
from picotron.plan.search import (SPACE, Plan, bounding, candidates, check_layout, counts_above,  # noqa: F401
                                  fewest_gpus, least_memory, rank_of, search, trainer_problem, why_faster)
from picotron.plan.published import PUBLISHED, Published, evaluate_published  # noqa: F401
from picotron.plan.cli import PlanError, build_parser, main, print_published  # noqa: F401
