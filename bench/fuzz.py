"""Fuzzing benchmark: 10,000+ generated requests at every op of six real role processes.

    OMP_NUM_THREADS=1 /work/main/.venv/bin/python -m bench.fuzz --cases 10000 --json bench/results/fuzz.json

Starts its own nats-server and one process of every role (tiny models), then runs the
harness of `tests/support/fuzzing.py` (the default suite's `tests/system/test_fuzz.py` runs it with ~1,200
cases): raw bytes, broken envelopes and typed requests for every op each role lists in its
``info`` reply, the inferencer's predict subject and the durable spec intake. It prints one
row per target (cases, answers seen, internal errors, unanswered, max reply latency), every
problem with its input, each role's RSS after the warm-up and at the end, and writes all of
it as JSON. Exit status 1 when any request went unanswered, answered ``internal``, a role
died, or a role's RSS grew by --rss-limit-mib or more (a problem listed in
tests/system/test_fuzz.py KNOWN_HANDLER_BUGS is reported but does not fail the run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import fuzz_report, fuzzing  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=10_000, help="total cases, spread evenly over the targets")
    p.add_argument("--warmup-fraction", type=float, default=0.2, help="share of each target's cases sent before "
                                                                       "the RSS baseline is read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-limit-mib", type=float, default=64.0)
    p.add_argument("--json", type=Path, default=Path("bench/results/fuzz.json"))
    args = p.parse_args(argv)

    from transport.broker import EmbeddedBroker, free_port
    from transport.bus import Bus
    from transport.layout import ensure_layout
    from protocol.subjects import Names
    from tests.conftest import RoleProcs, write_libero_like

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nexus-fuzz-") as tmp:
        broker = EmbeddedBroker(data_dir=Path(tmp) / "nats", port=free_port())
        broker.start()
        prefix = "fuzz"
        roles = RoleProcs(broker.url, prefix, Path(tmp))
        try:
            async def layout() -> None:
                bus = await Bus.connect(broker.url, name="fuzz-layout", reconnect_forever=False)
                try:
                    await ensure_layout(bus.js, Names(prefix))
                finally:
                    await bus.close()

            asyncio.run(layout())
            fuzzing.start_roles(roles)
            dataset = write_libero_like(Path(tmp) / "datasets" / "libero_like")  # what `sample` cases read
            ctx = asyncio.run(fuzzing.make_context(broker.url, prefix, dataset))
            run = asyncio.run(fuzzing.fuzz(broker.url, prefix, roles.procs, ctx, args.cases, args.warmup_fraction,
                                           seed=args.seed))
            alive = {role: proc.poll() is None for role, _, proc in roles.procs}
            logs = {inst: roles.log(inst)[-4000:] for role, inst, proc in roles.procs if proc.poll() is not None}
        finally:
            roles.stop_all()
            broker.stop()

    stats = fuzz_report.summarize(run.outcomes)
    found = fuzz_report.problems(run.outcomes)
    print(f"{len(run.outcomes)} cases on {len(run.targets)} targets in {run.wall_s:.1f} s "
          f"(whole run {time.monotonic() - started:.1f} s, seed {args.seed})")
    print(fuzz_report.table(stats))
    grown = {r: (run.rss_end_kib[r] - run.rss_warm_kib[r]) / 1024 for r in run.rss_warm_kib}
    print(f"\n{'ROLE':12} {'ALIVE':>5} {'RSS WARM MiB':>12} {'RSS END MiB':>11} {'GROWTH MiB':>10}")
    for r in run.rss_warm_kib:
        print(f"{r:12} {str(alive[r]):>5} {run.rss_warm_kib[r] / 1024:12.1f} {run.rss_end_kib[r] / 1024:11.1f} "
              f"{grown[r]:10.1f}")
    print(f"\nregression cases failing: {len(run.regressions)}; concurrent samples failing: {len(run.concurrency)}")
    for line in [line for _, line in run.regressions] + run.concurrency:
        print("  " + line)
    print(f"\n{len(found)} problems")
    for o in found:
        print(fuzz_report.describe(o))
    for inst, text in logs.items():
        print(f"--- log of dead {inst} ---\n{text}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "cases": len(run.outcomes), "targets": len(run.targets), "wall_s": round(run.wall_s, 2), "seed": args.seed,
        "per_target": {label: {"cases": s.cases, "answers": dict(s.answers), "internal": s.internal,
                               "no_reply": s.no_reply, "bad_reply": s.bad_reply,
                               "max_latency_s": round(s.max_latency_s, 4)} for label, s in stats.items()},
        "problems": [{"target": o.case.target.label, "problem": o.problem, "mode": o.case.mode,
                      "message": o.message, "input": o.case.shown, "bytes_hex": o.case.payload[:4096].hex()}
                     for o in found],
        "regressions_failing": [line for _, line in run.regressions], "concurrent_samples_failing": run.concurrency,
        "roles": {r: {"alive": alive[r], "rss_warm_kib": run.rss_warm_kib[r], "rss_end_kib": run.rss_end_kib[r],
                      "answers_info": run.infos.get(r) is not None} for r in run.rss_warm_kib},
    }, indent=1))
    print(f"wrote {args.json}")
    from tests.system.test_fuzz import KNOWN_HANDLER_BUGS

    unknown = [o for o in found if (o.case.target.label, o.problem) not in KNOWN_HANDLER_BUGS]
    unknown_regressions = [label for label, _ in run.regressions if (label, "regression") not in KNOWN_HANDLER_BUGS]
    ok = not unknown and not unknown_regressions and not run.concurrency and all(alive.values()) \
        and all(g < args.rss_limit_mib for g in grown.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
