"""`--smoke`: the size tests/test_benchmarks.py runs each benchmark at. Every code path of the benchmark (both sides
built, compared, stepped, reported) on the tiniest model and batch that still take them, so that the test shows in
seconds that the benchmark runs; its numbers mean nothing at this size. The benchmark's own defaults stay its real
sizes, and a flag given beside --smoke still wins."""
MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)  # the tiny preset's 8 heads (4 KV) of 8


def parse(parser, argv=None, **smoke):
    """parser.parse_args(argv) with a --smoke flag that makes `smoke` (and 2 rounds, 1 warm-up) the defaults; returns
    (args, model overrides for make_cfg: MODEL without the fields the script has flags of its own for, {} unsmoked)."""
    parser.add_argument("--smoke", action="store_true", help="the test's size: a tiny model and batch, 2 rounds; "
                                                             "shows the benchmark runs, in seconds (its numbers "
                                                             "mean nothing)")
    args = parser.parse_args(argv)
    if not args.smoke:
        return args, {}
    parser.set_defaults(**{"steps": 2, "warmup": 1, **smoke})
    args = parser.parse_args(argv)
    return args, {k: v for k, v in MODEL.items() if k not in vars(args)}
