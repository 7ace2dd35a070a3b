"""Running a typer app as a `nexus` command line: its outcome as the exit status (0 ok, 1 the
cluster or a role failed, 2 bad input, 130 interrupted), shared by `nexus` (sdk/cli.py) and
`python -m sdk.dataset_cli` without either importing the other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import typer

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _err(text: str) -> None:
    from sdk.term import err

    err(text, prefix="error: ")


def run_app(app: typer.Typer, argv: Sequence[str] | None = None, prog_name: str = "nexus") -> int:
    """Run ``app`` on ``argv`` (default ``sys.argv[1:]``); return its exit status."""
    from protocol.errors import NexusError

    try:
        rv: Any = app(args=None if argv is None else list(argv), prog_name=prog_name, standalone_mode=False)
    except typer.Exit as exc:  # --help, ctx.exit(code)
        return exc.exit_code
    except typer.Abort:
        return 130
    except typer.TyperException as exc:  # click's usage errors (typer vendors click)
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        _err(exc.format_message() + hint)
        return EXIT_BAD_INPUT if getattr(exc, "exit_code", 2) == 2 else EXIT_FAILED
    except NexusError as exc:
        _err(exc.message)
        return EXIT_BAD_INPUT if isinstance(exc, ValueError) else EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    return rv if isinstance(rv, int) else EXIT_OK
