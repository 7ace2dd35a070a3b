"""Every ```python and ```bash block of README.md and docs/*.md runs as written.

Blocks run in document order, each as its own process (`bash -e -o pipefail FILE` or
`python FILE`), in a scratch checkout against one real cluster started for the module
(`nexus up --detach --data-dir .nexus-docs --nats-port <free>`). The scratch checkout holds what
a reader's checkout holds: `examples/`, `.venv` (the project's venv), `.nexus-docs` (the
cluster's data dir) and `../shared` (the fixtures); `nexus` and `python` on PATH are the
project's.

A block may be marked by an HTML comment on the line right before it:

    <!-- example: skip (REASON) -->   not run here; the reason is required
    <!-- example: own-cluster -->     starts and stops its own cluster (`nexus up` ... `nexus down`):
                                      it runs first, in a scratch checkout of its own
    <!-- example: needs (MODULE: what it is) -->   runs where MODULE imports (an optional
                                      extra such as a simulator), else skips naming it

The only substitutions, each standing in for what a reader's machine has:
  * `nats://127.0.0.1:4222` becomes the test cluster's URL, and `nexus up` gets its port from
    NEXUS_NATS_PORT (the test's servers listen on free ports, never on 4222);
  * the default data dir `.nexus` becomes `.nexus-docs` in the blocks and the examples, and
    NEXUS_DATA_DIR names it (a reader with another data dir does the same: every command
    takes `--data-dir` or NEXUS_DATA_DIR), so nothing passes only on the default one;
  * the `examples/*.yaml` in the scratch checkout are the repository's with the budget fields
    in SHRINK made small (a few steps and episodes instead of minutes of training); every
    other field is as shipped, and each shrunk file must still validate.

After the docs, the same cluster answers the CLI's `--json` commands (parsed here) and a
`nexus submit --wait` whose plain (non-TTY) progress lines are checked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from transport.broker import free_port
from tests.conftest import ROOT, nexus_cmd, python_env

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = ("python", "bash")
MARKER = re.compile(r"^<!--\s*example:\s*(?P<kind>[a-z-]+)\s*(?:\((?P<reason>[^)]*)\))?\s*-->$")
DOC_URL = "nats://127.0.0.1:4222"
DATA_DIR = ".nexus-docs"  # the docs' default `.nexus`, moved: the examples must not rely on it
_DEFAULT_DATA_DIR = re.compile(r"(?<![\w.-])\.nexus(?![\w-])")


def move_data_dir(text: str) -> str:
    """``text`` with each mention of the default data dir `.nexus` naming DATA_DIR instead."""
    return _DEFAULT_DATA_DIR.sub(DATA_DIR, text)
BLOCK_TIMEOUT_S = 300
# Budget fields of the shipped examples made small for the test (dotted path -> value).
SHRINK: dict[str, dict[str, object]] = {
    "sft_reach.yaml": {"env.demos.episodes": 2, "algorithm.steps": 4, "algorithm.batch_size": 8,
                       "algorithm.items_per_job": 2, "algorithm.warmup_steps": 0,
                       "schedule.sft_prefetch_items": 2, "eval.episodes": 1, "outputs.export_every_steps": 2},
    "rl_reach.yaml": {"algorithm.steps_per_update": 16, "algorithm.micro_batch": 16, "algorithm.parallel_envs": 2,
                      "algorithm.epochs": 1, "schedule.budget": {"max_episodes": 2, "max_wall_s": 300},
                      "eval.episodes": 1},
    "eval_reach.yaml": {"eval.episodes": 1},
    "sft_lerobot.yaml": {"algorithm.steps": 4},
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str = ""  # "", "skip", "own-cluster" or "needs"
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract_blocks(path: Path) -> list[Block]:
    """The fenced blocks of one markdown file (every language), with the marker before each."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        m = MARKER.match(prev)
        blocks.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                            m.group("kind") if m else "", (m.group("reason") or "").strip() if m else ""))
        i = j + 1
    return blocks


ALL_BLOCKS = [b for doc in DOCS for b in extract_blocks(doc)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.lang in RUNNABLE]
# Own-cluster blocks first: they must not run beside the module's cluster.
ORDERED = sorted(RUN_BLOCKS, key=lambda b: b.marker != "own-cluster")


def test_markers_are_well_formed():
    """Every `<!-- example: ... -->` is `skip (reason)`, `needs (module: what)` or `own-cluster`,
    right before a runnable block."""
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if not line.strip().startswith("<!-- example"):
                continue  # prose may quote the markers; a marker is a line of its own
            m = MARKER.match(line.strip())
            assert m, f"{doc.name}:{n}: malformed marker {line!r}"
            assert m.group("kind") in ("skip", "own-cluster", "needs"), f"{doc.name}:{n}: unknown marker {m.group('kind')!r}"
            if m.group("kind") in ("skip", "needs"):
                assert (m.group("reason") or "").strip(), f"{doc.name}:{n}: {m.group('kind')} needs its reason"
    marked = [b for b in ALL_BLOCKS if b.marker]
    assert all(b.lang in RUNNABLE for b in marked), [b.id for b in marked if b.lang not in RUNNABLE]
    assert len(RUN_BLOCKS) >= 8  # the extractor finds the docs' examples at all


def _shrink(spec: dict, changes: dict[str, object]) -> dict:
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = spec
        for key in parents:
            assert key in node, f"SHRINK names {dotted!r}, but the example has no {key!r}"
            node = node[key]
        assert leaf in node, f"SHRINK names {dotted!r}, but the example has no {leaf!r}"
        node[leaf] = value
    return spec


def make_checkout(root: Path) -> Path:
    """A scratch checkout: shrunk examples, links to the venv and the shared fixtures."""
    from master.spec import load_spec

    checkout = root / "checkout"
    (checkout / "examples").mkdir(parents=True)
    for src in sorted((ROOT / "examples").iterdir()):
        dst = checkout / "examples" / src.name
        if src.is_dir():  # an example of several files (examples/hosted_env/): as shipped
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.name in SHRINK:
            dst.write_text(move_data_dir(yaml.safe_dump(_shrink(yaml.safe_load(src.read_text()), SHRINK[src.name]),
                                                        sort_keys=False)))
            load_spec(dst)  # a shrunk example must still be a valid spec
        else:
            dst.write_text(move_data_dir(src.read_text()))
    (checkout / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    shared = ROOT.parent / "shared"
    if shared.is_dir():
        (root / "shared").symlink_to(shared, target_is_directory=True)
    return checkout


def block_env(**extra: str) -> dict[str, str]:
    env = python_env(OMP_NUM_THREADS="1", **extra)
    for name in ("NEXUS_NATS_URL", "NEXUS_PREFIX", "NEXUS_DATA_DIR"):
        env.pop(name, None)  # only the block's own settings count
    env["NEXUS_DATA_DIR"] = DATA_DIR  # relative: the scratch checkout's, as `.nexus` is a reader's
    env["PATH"] = f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_block(block: Block, checkout: Path, url: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    code = move_data_dir(block.code.replace(DOC_URL, url))
    script = checkout / f"_block_{block.path.stem}_{block.line}.{'py' if block.lang == 'python' else 'sh'}"
    script.write_text(code)
    cmd = [sys.executable, str(script)] if block.lang == "python" else ["bash", "-e", "-o", "pipefail", str(script)]
    return subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def nexus(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(nexus_cmd(*args), cwd=cwd, env=env or block_env(), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


# The cluster's health timeout, above the default 3 s: on the shared 2-core test machine a role
# that imports torch on its event loop (the master, at its first submit) can miss 3 s of
# heartbeats and be restarted mid-request. The docs' examples are about the API, not that.
CLUSTER_ENV = {"NEXUS_HEALTH_TIMEOUT_S": "20"}


@pytest.fixture(scope="module")
def docs_cluster(tmp_path_factory):
    checkout = make_checkout(tmp_path_factory.mktemp("docs"))
    up = nexus("up", "--detach", "--data-dir", DATA_DIR, "--nats-port", str(free_port()), cwd=checkout,
               env=block_env(**CLUSTER_ENV))
    assert up.returncode == 0, up.stdout + up.stderr
    url = json.loads((checkout / DATA_DIR / "cluster.json").read_text())["nats_url"]
    yield checkout, url
    down = nexus("down", "--data-dir", DATA_DIR, cwd=checkout)
    assert down.returncode == 0, down.stdout + down.stderr


@pytest.mark.parametrize("block", ORDERED, ids=[b.id for b in ORDERED])
def test_doc_example_runs(block: Block, request, tmp_path):
    if block.marker == "skip":
        pytest.skip(block.reason)
    if block.marker == "needs":
        module = block.reason.split(":")[0].strip()
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {block.reason} (python module {module!r} is not installed)")
    if block.marker == "own-cluster":
        checkout = make_checkout(tmp_path)
        port = free_port()
        try:
            out = run_block(block, checkout, f"nats://127.0.0.1:{port}",
                            block_env(NEXUS_NATS_PORT=str(port), **CLUSTER_ENV))
        finally:
            nexus("down", "--data-dir", DATA_DIR, cwd=checkout)  # whatever the block left running
    else:
        checkout, url = request.getfixturevalue("docs_cluster")
        out = run_block(block, checkout, url, block_env())
    assert out.returncode == 0, f"{block.id} failed ({out.returncode}):\n{block.code}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"


# -- the CLI's --json output and plain progress lines, on the same cluster --------------------------
def _json(out: subprocess.CompletedProcess):
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def test_cli_json_outputs(docs_cluster, tmp_path):
    checkout, _ = docs_cluster
    status = _json(nexus("status", "--json", cwd=checkout))
    assert {r["role"] for r in status["roles"]} >= {"master", "trainer", "inferencer", "env", "health", "monitor"}
    assert any(w["tenant"] == "sft-reach" and w["state"] == "completed" for w in status["workloads"])

    tenants = {t["tenant"]: t for t in _json(nexus("tenants", "--json", cwd=checkout))}
    assert tenants["sft-reach"]["version"] >= 1 and tenants["sft-reach"]["head"] == "mlp"
    assert len(tenants["sft-reach"]["workloads"]) >= 1
    listed = _json(nexus("workloads", "list", "--tenant", "sft-reach", "--json", cwd=checkout))
    assert listed and {w["tenant"] for w in listed} == {"sft-reach"}
    assert {w["workload"] for w in _json(nexus("workloads", "--json", cwd=checkout))} >= {w["workload"] for w in listed}
    shown = _json(nexus("tenant", "show", "sft-reach", "--json", cwd=checkout))
    assert shown["config"]["name"] == "sft-reach" and shown["version"] == tenants["sft-reach"]["version"]

    files = _json(nexus("download", "sft-reach", "--out", str(tmp_path), "--json", cwd=checkout))
    assert Path(files["weights"]).stat().st_size > 0
    assert json.loads(Path(files["manifest"]).read_text())["version"] == tenants["sft-reach"]["version"]

    evals = [w for w in listed if w["task"] == "eval"]  # examples/eval_reach.yaml scores sft-reach, as sft-reach
    report = _json(nexus("download", evals[0]["workload"], "--report", "--out", str(tmp_path), "--json", cwd=checkout))
    assert json.loads(Path(report["report"]).read_text())  # the eval's report, as the master kept it

    spec = yaml.safe_load((checkout / "examples" / "sft_reach.yaml").read_text())
    long_spec = tmp_path / "long.yaml"
    long_spec.write_text(yaml.safe_dump({**spec, "tenant": "cli-cancel", "algorithm": {**spec["algorithm"], "steps": 10_000}}))
    submitted = _json(nexus("submit", str(long_spec), "--json", cwd=checkout))
    assert [s["tenant"] for s in submitted] == ["cli-cancel"] and submitted[0]["workload"]
    cancelled = _json(nexus("cancel", submitted[0]["workload"], "--json", cwd=checkout))
    assert cancelled["workload"] == submitted[0]["workload"] and cancelled["state"] == "cancelled"
    finished = nexus("cancel", evals[0]["workload"], cwd=checkout)  # it had completed: says so, changes nothing
    assert finished.returncode == 0 and "already completed" in finished.stdout and "nothing to cancel" in finished.stdout

    refused = nexus("tenant", "delete", "cli-cancel", cwd=checkout)  # no --yes, no terminal to ask on
    assert refused.returncode == 2 and "--yes" in refused.stderr
    gone = _json(nexus("tenant", "delete", "cli-cancel", "--yes", "--json", cwd=checkout))
    assert gone["tenant"] == "cli-cancel" and gone["removed"]["workloads"] == 1
    assert "cli-cancel" not in {t["tenant"] for t in _json(nexus("tenants", "--json", cwd=checkout))}

    missing = nexus("tenant", "show", "no-such-tenant", "--json", cwd=checkout)
    assert missing.returncode in (1, 2) and missing.stderr.startswith("error: ") and not missing.stdout


def test_submit_wait_prints_plain_progress_lines(docs_cluster, tmp_path):
    checkout, _ = docs_cluster
    spec = yaml.safe_load((checkout / "examples" / "sft_reach.yaml").read_text())
    small = tmp_path / "small.yaml"
    # The example's own spec, made small: 64 steps on 20 demos (the progress lines are what is tested).
    spec = {**spec, "tenant": "cli-progress", "eval": {**spec["eval"], "episodes": 1},
            "algorithm": {**spec["algorithm"], "steps": 64, "warmup_steps": 8},
            "env": {**spec["env"], "demos": {**spec["env"]["demos"], "episodes": 20}},
            "outputs": {**spec.get("outputs", {}), "export_every_steps": 32}}
    small.write_text(yaml.safe_dump(spec))
    out = nexus("submit", str(small), "--wait", "--json", cwd=checkout, timeout=300)
    recs = _json(out)
    assert [(r["tenant"], r["state"]) for r in recs] == [("cli-progress", "completed")], out.stderr
    steps = spec["algorithm"]["steps"]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith(recs[0]["workload"])]
    # Off a terminal: one plain line per change, no carriage returns or escape codes.
    assert "\r" not in out.stderr and "\x1b[" not in out.stderr
    assert lines and all("cli-progress" in ln and "sft" in ln for ln in lines)
    assert any(f"/{steps} steps" in ln and "[" in ln for ln in lines)
    assert lines[-1].split()[3] == "completed" and f"{steps}/{steps} steps" in lines[-1]
    assert len(lines) == len(set(lines))  # a line is printed only when something changed
