"""Regression cases of the fuzzing harness (tests/support/fuzzing.py): each input that once found
a handler bug, sent by name with the error code it must now get, and the concurrent-sample case
that once crashed the env worker."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from protocol import ops
from protocol.codec import packb
from protocol.messages import ErrorReply, PredictRequest
from protocol.subjects import Names
from protocol.wire import decode
from tests.support.fuzz_strategies import template, tensor_ext
from tests.support.fuzz_types import REPLY_TIMEOUT_S, Context


def regression_cases(ctx: Context, names: Names) -> list[tuple[str, str, bytes, str]]:
    """(label, subject, payload, expected error code) for each bug this harness found."""
    from protocol.messages import EnvCreateRequest, EnvResetRequest, EnvStepRequest, JobRef, LeaseRequest, \
        WorkflowSpec, QueuePutRequest, SampleRequest

    def env(cls: type, **over: Any) -> bytes:
        body = {**template(cls, ctx), **over}
        return packb({"kind": cls.KIND, "v": cls.VERSION, "body": body})  # type: ignore[attr-defined]

    bf16 = tensor_ext("bfloat16", (2, ctx.schema["state_dim"]))
    return [
        # IndexError in the trainer: an empty job made the lease pick any ready job.
        ("trainer.train_batch job ''", ops.TRAINER_TRAIN_BATCH.subject(names), env(JobRef, job=""), "invalid_field"),
        # InvalidKeyError from the KV: a tenant that is not a token.
        ("inferencer.predict tenant '*'", names.infer(pool_of(ctx)), env(PredictRequest, tenant="*"), "invalid_field"),
        # TypeError: a bfloat16 tensor has no numpy view.
        ("master.queue_put bf16 state", ops.MASTER_QUEUE_PUT.subject(names), env(QueuePutRequest, state=bf16), "invalid_field"),
        ("env.step bf16 action", ops.ENV_STEP.subject(names), env(EnvStepRequest, action=tensor_ext("bfloat16", (2,))),
         "invalid_field"),
        # OverflowError converting to int64; ValueError from numpy on a negative seed.
        ("env.sample index 2**64-1", ops.ENV_SAMPLE.subject(names), env(SampleRequest, indices=[2**64 - 1]), "invalid_field"),
        ("env.sample seed -1", ops.ENV_SAMPLE.subject(names), env(SampleRequest, seed=-1), "invalid_field"),
        # A negative seed made reset raise, and the session was closed as crashed.
        ("env.reset seed -1", ops.ENV_RESET.subject(names), env(EnvResetRequest, seed=-1), "invalid_field"),
        # TypeError / ValueError in the built-in env's config; an unbounded image size.
        ("env.create options.seed 'x'", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"seed": "x"}),
         "invalid_field"),
        ("env.create options.max_step 'x'", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"max_step": "x"}),
         "invalid_field"),
        ("env.create image 10**6", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"image_height": 10**6}),
         "invalid_field"),
        ("env.create options.image_size 5.0", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"image_size": 5.0}),
         "invalid_field"),
        # Not a token: the workflow ran, but none of its events could be published.
        ("env.start_workflow workload 'w.x'", ops.ENV_START_WORKFLOW.subject(names),
         env(WorkflowSpec, workload="w.x"), "invalid_field"),
        # An option the env's config did not type-check itself (TypeError in ReachConfig).
        ("env.create options.cameras 5", ops.ENV_CREATE.subject(names), env(EnvCreateRequest, options={"cameras": 5}),
         "invalid_field"),
        # nan never expires: the job would stay leased forever.
        ("master.lease lease_s nan", ops.MASTER_LEASE.subject(names), env(LeaseRequest, lease_s=math.nan), "invalid_field"),
        # <= 0: dropped unworked, no reply ever.
        ("inferencer.predict timeout_s -1", names.infer(pool_of(ctx)), env(PredictRequest, timeout_s=-1.0),
         "invalid_field"),
    ]


def pool_of(ctx: Context) -> str:
    from protocol.subjects import pool_name

    return pool_name(ctx.base)


async def check_regressions(nc: Any, ctx: Context, names: Names) -> list[tuple[str, str]]:
    """Send every regression case; return (label, what came back) per case whose answer is
    not the expected code."""
    bad = []
    for label, subject, payload, want in regression_cases(ctx, names):
        try:
            msg = await nc.request(subject, payload, timeout=REPLY_TIMEOUT_S)
            reply = decode(msg.data)
            got = reply.code if isinstance(reply, ErrorReply) else type(reply).__name__
            text = reply.message if isinstance(reply, ErrorReply) else ""
        except Exception as exc:  # no reply: that is the failure we report
            got, text = type(exc).__name__, str(exc)
        if got != want:
            bad.append((label, f"{label}: expected {want}, got {got} {text[:200]}"))
    return bad


async def concurrent_samples(nc: Any, ctx: Context, names: Names, n: int = 16) -> list[str]:
    """``n`` sample requests on one dataset at once: the env worker's reader threads shared
    PyAV containers and segfaulted the worker (every later request went unanswered)."""
    from protocol.messages import SampleRequest

    payload = packb({"kind": SampleRequest.KIND, "v": SampleRequest.VERSION, "body": template(SampleRequest, ctx)})
    replies = await asyncio.gather(*(nc.request(ops.ENV_SAMPLE.subject(names), payload, timeout=REPLY_TIMEOUT_S)
                                     for _ in range(n)), return_exceptions=True)
    out = []
    for r in replies:
        if isinstance(r, BaseException):
            out.append(f"{type(r).__name__}: {r}")
        elif type(decode(r.data)).__name__ != "DatasetBatch":
            out.append(repr(decode(r.data))[:200])
    return out
