"""`nexus dataset ...`: inspect, record and publish LeRobot v3.0 datasets.

`dataset_app` is the typer sub-app `nexus dataset` mounts. The same handlers (`cmd_info`,
`cmd_show`, `cmd_record`: an argparse-style namespace in, an exit status out: 0 ok, 2 on a clear
user-facing error printed to stderr) can also be wired into an argparse CLI with
`add_dataset_commands(subparsers)`. Also runnable alone:

    python -m sdk.dataset_cli info ../shared/fixtures/lerobot/libero_like [--json]
    python -m sdk.dataset_cli show ../shared/fixtures/lerobot/libero_like --index 45 --json
    python -m sdk.dataset_cli record --out /tmp/reach_demos --episodes 20 [--env builtin/reach-v0]
        [--seed 0] [--video | --images] [--overwrite]
    python -m sdk.dataset_cli publish /tmp/reach_demos reach-demos [--data-dir DIR] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer

from protocol.errors import NexusError
from protocol.settings import RoleSettings

EXIT_OK = 0
EXIT_USAGE = 2


def _fail(command: str, message: str) -> int:
    from sdk.term import err

    err(message, prefix=f"nexus dataset {command}: error: ")
    return EXIT_USAGE


def _guard(command: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn the errors we raise on purpose (and missing files) into a message and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except NexusError as e:
            return _fail(command, e.message)
        except OSError as e:
            return _fail(command, str(e))

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def dataset_summary(path: str) -> dict[str, Any]:
    from envs.lerobot import LeRobotReader

    with LeRobotReader(path) as ds:
        m = ds.meta
        return {
            "root": str(m.root),
            "codebase_version": m.codebase_version,
            "robot_type": m.robot_type,
            "fps": m.fps,
            "total_episodes": m.total_episodes,
            "total_frames": len(ds),
            "total_tasks": len(m.tasks),
            "features": {k: {"dtype": f.dtype, "shape": list(f.shape), "names": f.names}
                         for k, f in m.features.items()},
            "camera_keys": m.camera_keys,
            "tasks": {str(i): t for i, t in sorted(m.tasks.items())},
            "episodes": [{"episode_index": e.episode_index, "length": e.length, "tasks": list(e.tasks)}
                         for e in m.episodes],
        }


def frame_summary(path: str, index: int) -> dict[str, Any]:
    from envs.lerobot import LeRobotReader

    with LeRobotReader(path) as ds:
        f = ds[index]
        cameras = {}
        for key, img in f.images.items():
            # Per-channel mean of the image as a float32 [0, 1] tensor (lerobot's convention).
            chw = img.transpose(2, 0, 1).astype(np.float32) / 255.0
            means = chw.astype(np.float64).mean(axis=(1, 2)).tolist()
            cameras[key] = {"shape": list(img.shape), "mean_per_channel": means}
        return {
            "index": f.index,
            "episode_index": f.episode_index,
            "frame_index": f.frame_index,
            "timestamp": f.timestamp,
            "task_index": f.task_index,
            "task": f.task,
            "state": None if f.state is None else f.state.tolist(),
            "action": None if f.action is None else f.action.tolist(),
            "cameras": cameras,
        }


def _fmt_vec(v: Sequence[float] | None) -> str:
    return "-" if v is None else "[" + ", ".join(f"{x:.4f}" for x in v) + "]"


def cmd_info(args: argparse.Namespace) -> int:
    """Summary of a dataset: fps, features, episodes, frames, tasks."""
    s = dataset_summary(args.path)
    if args.json:
        print(json.dumps(s, indent=2))
        return EXIT_OK
    print(f"dataset   {s['root']}")
    print(f"version   {s['codebase_version']}   robot {s['robot_type']}   fps {s['fps']}")
    print(f"episodes  {s['total_episodes']}   frames {s['total_frames']}   tasks {s['total_tasks']}")
    print("features:")
    width = max(len(k) for k in s["features"])
    for k, f in s["features"].items():
        print(f"  {k:<{width}}  {f['dtype']:<8} {tuple(f['shape'])}")
    print("tasks:")
    for i, t in s["tasks"].items():
        print(f"  {i:>3}  {t}")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    """One frame: indices, timestamp, task, state, action, per-camera channel means."""
    s = frame_summary(args.path, args.index)
    if args.json:
        print(json.dumps(s, indent=2))
        return EXIT_OK
    print(f"index {s['index']}   episode {s['episode_index']}   frame {s['frame_index']}   t={s['timestamp']:.4f}s")
    print(f"task   [{s['task_index']}] {s['task']}")
    print(f"state  {_fmt_vec(s['state'])}")
    print(f"action {_fmt_vec(s['action'])}")
    for key, c in s["cameras"].items():
        print(f"{key}  {tuple(c['shape'])}  mean RGB {_fmt_vec(c['mean_per_channel'])}")
    return EXIT_OK


def cmd_record(args: argparse.Namespace) -> int:
    """Run the env's scripted expert and write a LeRobot v3.0 dataset."""
    from envs.lerobot import RecordConfig, RecordProgress, record

    def progress(p: RecordProgress) -> None:
        end = "\n" if p.episodes >= p.target else ""
        print(f"\rrecord: episode {p.episodes}/{p.target}  attempts {p.attempts}  frames {p.frames}",
              end=end, file=sys.stderr, flush=True)

    result = record(
        RecordConfig(out=args.out, episodes=args.episodes, env_id=args.env, seed=args.seed,
                     use_videos=args.storage == "video", overwrite=args.overwrite,
                     action_noise=args.noise, env_kwargs=dict(args.env_option)),
        progress=progress,
    )
    print(f"wrote {result.episodes} episodes, {result.frames} frames to {result.root} "
          f"({result.successes}/{result.attempts} expert attempts succeeded)")
    return EXIT_OK


def cmd_publish(args: argparse.Namespace) -> int:
    """Copy a dataset into the data dir's published area (an operator's act), where every
    tenant may name it as dataset.root and no tenant request writes."""
    from transport.datasets import publish_dataset

    try:
        # Not given: the deployment's, as every other `nexus` command finds it (NEXUS_DATA_DIR).
        data_dir = Path(args.data_dir) if args.data_dir else RoleSettings.from_env().data_dir
        target = publish_dataset(args.src, args.name, data_dir, overwrite=args.overwrite)
    except ValueError as exc:
        return _fail("publish", str(exc))
    print(f"published {args.src} as {args.name!r}: tenants name dataset.root {target}")
    return EXIT_OK


def _env_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value read as YAML (so 128, true, [top, wrist] and rgb all work)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"{key}: value {value!r} is not valid YAML: {exc}") from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_dataset_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("dataset", help="inspect or record LeRobot v3.0 datasets")
    sub = parser.add_subparsers(dest="dataset_command", metavar="{info,show,record,publish}", required=True)

    p = sub.add_parser("info", help="fps, features, episodes, frames, tasks")
    p.add_argument("path", help="dataset root (holds meta/info.json)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_guard("info", cmd_info))

    p = sub.add_parser("show", help="one frame: task, state, action, per-camera channel means")
    p.add_argument("path", help="dataset root (holds meta/info.json)")
    p.add_argument("--index", type=int, required=True, help="global frame index (0-based)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_guard("show", cmd_show))

    p = sub.add_parser("record", help="record scripted-expert demonstrations")
    p.add_argument("--out", required=True, help="new dataset root")
    p.add_argument("--episodes", type=_positive_int, required=True)
    p.add_argument("--env", default="builtin/reach-v0", help="registered env id (default: builtin/reach-v0)")
    p.add_argument("--seed", type=int, default=0, help="episode i resets with seed+i")
    p.add_argument("--env-option", type=_env_option, action="append", default=[], metavar="KEY=VALUE",
                   help="an env option, value read as YAML (repeatable), e.g. obs_mode=rgb image_size=128")
    p.add_argument("--noise", type=float, default=0.0,
                   help="DART noise: std of the Gaussian added to the executed expert action "
                        "(the recorded label stays clean)")
    storage = p.add_mutually_exclusive_group()
    storage.add_argument("--video", dest="storage", action="store_const", const="video",
                         help="cameras as AV1 mp4 (default)")
    storage.add_argument("--images", dest="storage", action="store_const", const="images",
                         help="cameras as PNG in the data parquet")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --out")
    p.set_defaults(storage="video", func=_guard("record", cmd_record))

    p = sub.add_parser("publish", help="copy a dataset into the data dir's published area (operator)")
    p.add_argument("src", help="dataset root (holds meta/info.json)")
    p.add_argument("name", help="published name: 1-64 of A-Z a-z 0-9 _ -")
    p.add_argument("--data-dir", default=None, help="the deployment's data dir (default NEXUS_DATA_DIR, else ./.nexus)")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset published under NAME")
    p.set_defaults(func=_guard("publish", cmd_publish))
    return parser


# -- typer: `nexus dataset ...` -----------------------------------------------------------------
dataset_app = typer.Typer(help="inspect or record LeRobot v3.0 datasets", no_args_is_help=True)
DatasetPath = Annotated[str, typer.Argument(metavar="PATH", help="dataset root (holds meta/info.json)")]
JsonFlag = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _env_options(values: list[str]) -> list[tuple[str, Any]]:
    try:
        return [_env_option(v) for v in values]
    except argparse.ArgumentTypeError as exc:
        raise typer.BadParameter(str(exc)) from None


@dataset_app.command("info")
def info_command(path: DatasetPath, json: JsonFlag = False) -> int:
    """fps, features, episodes, frames, tasks."""
    return _guard("info", cmd_info)(argparse.Namespace(path=path, json=json))


@dataset_app.command("show")
def show_command(
    path: DatasetPath,
    index: Annotated[int, typer.Option("--index", help="global frame index (0-based)")],
    json: JsonFlag = False,
) -> int:
    """One frame: task, state, action, per-camera channel means."""
    return _guard("show", cmd_show)(argparse.Namespace(path=path, index=index, json=json))


@dataset_app.command("record")
def record_command(
    out: Annotated[Path, typer.Option("--out", help="new dataset root")],
    episodes: Annotated[int, typer.Option("--episodes", min=1, help="episodes to record")],
    env: Annotated[str, typer.Option("--env", help="registered env id")] = "builtin/reach-v0",
    seed: Annotated[int, typer.Option("--seed", help="episode i resets with seed+i")] = 0,
    env_option: Annotated[list[str] | None, typer.Option(
        "--env-option", metavar="KEY=VALUE",
        help="an env option, value read as YAML (repeatable), e.g. obs_mode=rgb image_size=128")] = None,
    noise: Annotated[float, typer.Option(
        "--noise", help="DART noise: std of the Gaussian added to the executed expert action "
                        "(the recorded label stays clean)")] = 0.0,
    video: Annotated[bool, typer.Option("--video", help="cameras as AV1 mp4 (the default)")] = False,
    images: Annotated[bool, typer.Option("--images", help="cameras as PNG in the data parquet")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an existing dataset at --out")] = False,
) -> int:
    """Record scripted-expert demonstrations."""
    if video and images:
        raise typer.BadParameter("--video and --images exclude each other", param_hint="--video / --images")
    args = argparse.Namespace(out=str(out), episodes=episodes, env=env, seed=seed, noise=noise,
                              env_option=_env_options(env_option or []),
                              storage="images" if images else "video", overwrite=overwrite)
    return _guard("record", cmd_record)(args)


@dataset_app.command("publish")
def publish_command(
    src: Annotated[str, typer.Argument(metavar="SRC", help="dataset root (holds meta/info.json)")],
    name: Annotated[str, typer.Argument(metavar="NAME", help="published name: 1-64 of A-Z a-z 0-9 _ -")],
    data_dir: Annotated[Path | None, typer.Option(
        "--data-dir", show_default=False, help="the deployment's data dir (default NEXUS_DATA_DIR, else ./.nexus)")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace a dataset published under NAME")] = False,
) -> int:
    """Publish a dataset to every tenant: copied to <data dir>/datasets/published/NAME, read-only."""
    args = argparse.Namespace(src=src, name=name, data_dir=data_dir, overwrite=overwrite)
    return _guard("publish", cmd_publish)(args)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sdk.dataset_cli ...`: the same as `nexus dataset ...` (this sub-app under a
    `nexus` of its own, run as `nexus` runs its commands, so the two modules stay apart)."""
    from sdk.cli_run import run_app

    nexus = typer.Typer(name="nexus", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
    nexus.add_typer(dataset_app, name="dataset")
    return run_app(nexus, ["dataset", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
