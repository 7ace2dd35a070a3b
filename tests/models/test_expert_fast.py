"""Action experts on the fast engine (models/fast.py `kv=True`, models/heads/expert.py
`EulerBucket`): the fast forward returns the per-layer prefix KV cache the plain
`Family.forward_kv` returns (keys, values, next positions, hidden; CPU fp32, tight tolerance),
the plain core never runs for an expert group, and the grouped Euler loop on fixed buffers
(GQA without repeating the cache, a bucket reused across calls) samples what the plain grouped
and the serial paths sample (1e-5), in a group mixing experts with frozen-base and LoRA rows.
The CUDA graph of the loop is CUDA-only; its eager twin on the same buffers runs here."""

from __future__ import annotations

import os
import shutil

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models import BaseConfig, BaseModel, OptimConfig, TenantSlot, predict, train_step
from models.fast import FastQwen3VLEncoder
from models.features import VLABatch
from models.group import encode_grouped
from models.heads.expert import EulerBucket, EulerOptions, set_euler_options
from models.lora import AdapterConfig, router_for
from models.testing import calvin_schema, libero_schema, random_batch
from tests.models.grouping import rel, start_adapters_off_zero

torch.set_num_threads(1)

TOL = 1e-5
LORA = AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def fast() -> BaseModel:
    return BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True))


def tenants(base: BaseModel) -> list[tuple]:
    kv = base.attention_shape().kv_heads
    same = {"width": 32, "euler_steps": 3}
    return [  # (schema, head, options, adapter, rows)
        (libero_schema(), "expert", same, None, 2),
        (libero_schema(), "mlp", {"width": 32}, None, 2),  # frozen-base rows in the expert group
        (libero_schema(), "expert", same, None, 2),  # same bucket as the first
        (libero_schema(), "mlp", {"width": 32}, LORA, 2),  # LoRA rows in the same forward
        (calvin_schema(), "expert", {"width": 24, "depth": 1, "num_heads": 2 * kv, "euler_steps": 2}, None, 2),
        (libero_schema(), "expert", same, LORA, 2),  # an expert on its own adapter's rows
        (libero_schema(), "expert", same, None, 1),  # fewer rows: a bucket of one
    ]


def make_slots(base: BaseModel) -> list[TenantSlot]:
    optim = OptimConfig(lr=3e-3, warmup_steps=1, total_steps=4)
    return start_adapters_off_zero([
        TenantSlot.create(f"t{i}", schema, base, head_kind=head, head_options=opts, optim=optim, seed=50 + i,
                          adapter=adapter)
        for i, (schema, head, opts, adapter, _) in enumerate(tenants(base))])


def vlas_for(base: BaseModel, slots: list[TenantSlot], step: int = 0) -> list[VLABatch]:
    return [random_batch(s.preprocessor, t[-1], seed=100 * i + step).features
            for i, (s, t) in enumerate(zip(slots, tenants(base)))]


def assert_prefix_same(out, ref, tol: float = TOL) -> None:
    assert torch.equal(out.mask_B_L, ref.mask_B_L)
    assert torch.equal(out.prefix.next_pos_B, ref.prefix.next_pos_B)
    assert float((out.hidden_B_L_D - ref.hidden_B_L_D).abs().max()) <= tol
    assert len(out.prefix.keys) == len(ref.prefix.keys) == len(out.prefix.values)
    for k, rk, v, rv in zip(out.prefix.keys, ref.prefix.keys, out.prefix.values, ref.prefix.values, strict=True):
        assert k.shape == rk.shape and k.dtype == rk.dtype and v.shape == rv.shape and v.dtype == rv.dtype
        # every position, padding included: a NaN there would reach the expert as 0 * NaN
        assert float((k - rk).abs().max()) <= tol and float((v - rv).abs().max()) <= tol


@pytest.mark.parametrize("fused", [False, True])
def test_fast_prefix_kv_equals_forward_kv(base: BaseModel, fast: BaseModel, fused: bool) -> None:
    engine = fast._fast
    if fused:
        fast._fast = FastQwen3VLEncoder(fast, fused=True)
    try:
        slots = make_slots(base)
        packed = VLABatch.cat([random_batch(slots[0].preprocessor, 3, seed=7).features,
                               random_batch(slots[1].preprocessor, 2, seed=8).features])
        calls = []
        handle = fast.core.register_forward_pre_hook(lambda *_: calls.append(1))
        try:
            out = fast.encode(packed, inference=True, prefix_kv=True)
        finally:
            handle.remove()
        assert not calls  # the fast engine's forward, not the transformers one
        assert_prefix_same(out, base.encode(packed, inference=True, prefix_kv=True))
        # The cache outputs do not change the frozen forward's hidden states.
        with torch.inference_mode():
            hidden, _ = fast._fast(packed)
        assert torch.equal(hidden, out.hidden_B_L_D)
    finally:
        fast._fast = engine


def test_mixed_group_cache_on_the_fast_engine(base: BaseModel, fast: BaseModel) -> None:
    """Expert, frozen and LoRA rows: one fast forward with adapter rows and cache outputs."""
    plain_slots, fast_slots = make_slots(base), make_slots(fast)
    vlas = vlas_for(base, plain_slots)
    router = router_for(fast)
    calls = router.calls
    out = encode_grouped(fast, vlas, slots=fast_slots, inference=True)
    assert router.calls == calls  # no segmented hook: the LoRA deltas were the fast engine's
    ref = encode_grouped(base, vlas, slots=plain_slots, inference=True)
    for o, r in zip(out, ref, strict=True):
        assert_prefix_same(o, r)
    # The adapted expert's cache is its adapter's (else the comparison above could not fail).
    frozen = base.encode(vlas[5], inference=True, prefix_kv=True)
    assert rel(out[5].prefix.values[0], frozen.prefix.values[0]) > 1e-4


def test_predict_fast_grouped_equals_plain_grouped_and_serial(base: BaseModel, fast: BaseModel) -> None:
    runs = {}
    for name, b, grouped in (("fast", fast, True), ("plain", base, True), ("serial", base, False),
                             ("fast-serial", fast, False)):
        slots = make_slots(b)
        runs[name] = predict(b, list(zip(slots, vlas_for(base, slots))), grouped=grouped)
    for name in ("fast", "plain", "fast-serial"):
        for i, (a, s) in enumerate(zip(runs[name], runs["serial"], strict=True)):
            assert a.shape == s.shape
            assert rel(a, s) < TOL, (name, i, rel(a, s))


def test_buckets_are_reused_and_see_each_step(base: BaseModel, fast: BaseModel) -> None:
    """A second grouped predict after a training step reuses the bucket (its weights restacked:
    the optimizer changed them in place) and still equals the serial sampling."""
    EulerBucket._cache.clear()
    g_slots, s_slots = make_slots(fast), make_slots(base)
    for step in range(2):
        if step:
            for slots, b in ((g_slots, fast), (s_slots, base)):
                vl = vlas_for(base, slots, step)
                items = [(s, random_batch(s.preprocessor, len(v), seed=10 + i)) for i, (s, v) in enumerate(zip(slots, vl))]
                train_step(b, items, grouped=True)
        vlas = vlas_for(base, g_slots, step)
        g = predict(fast, list(zip(g_slots, vlas)), grouped=True)
        s = predict(base, list(zip(s_slots, vlas)), grouped=False)
        for i, (a, r) in enumerate(zip(g, s, strict=True)):
            assert rel(a, r) < TOL, (step, i, rel(a, r))
        if step == 0:
            buckets = dict(EulerBucket._cache)
    # Three expert buckets (t0, t2 and the adapted t5: one shape, two rows each; the shallow
    # one; the one-row one), the same objects on the second call.
    assert len(buckets) == 3 and all(EulerBucket._cache[k] is v for k, v in buckets.items())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None,
                    reason="torch.compile's inductor needs a C compiler (gcc, or $CC) on PATH")
def test_compiled_engine_returns_the_cache(base: BaseModel) -> None:
    """compile=True: the decoder layer that returns its cache is a compiled block too, and a mixed
    group's cache and actions equal the plain path's (about a minute of CPU)."""
    torch._dynamo.reset()
    compiled = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True, compile=True))
    plain_slots, slots = make_slots(base), make_slots(compiled)
    vlas = vlas_for(base, plain_slots, 3)
    out = encode_grouped(compiled, vlas, slots=slots, inference=True)
    for o, r in zip(out, encode_grouped(base, vlas, slots=plain_slots, inference=True), strict=True):
        assert_prefix_same(o, r)
    acts = predict(compiled, list(zip(slots, vlas)), grouped=True)
    refs = predict(base, list(zip(make_slots(base), vlas)), grouped=False)
    for i, (a, r) in enumerate(zip(acts, refs, strict=True)):
        assert rel(a, r) < TOL, (i, rel(a, r))


def test_euler_options_parse_and_refuse() -> None:
    assert EulerOptions.parse("fp32") == EulerOptions()
    assert EulerOptions.parse("compile+tf32") == EulerOptions(tf32=True, compile=True)
    with pytest.raises(ValueError, match="unknown \\['bf16'\\].*allowed: fp32, tf32"):
        EulerOptions.parse("compile+bf16")


def test_unchanged_weights_are_not_restacked(base: BaseModel, fast: BaseModel) -> None:
    """A bucket restacks the experts' weights only when a tenant's parameters changed in place
    (version counters) or another tenant's came in: here a weight written by hand between two
    predicts must show in the second one's actions."""
    EulerBucket._cache.clear()
    slots = make_slots(fast)
    vlas = vlas_for(base, slots)
    pairs = list(zip(slots, vlas))
    states = [s.generator.get_state() for s in slots]

    def again() -> list[torch.Tensor]:
        for s, st in zip(slots, states):
            s.generator.set_state(st)
        return predict(fast, pairs, grouped=True)

    first, same = again(), again()
    assert all(torch.equal(a, b) for a, b in zip(first, same))
    bucket = next(iter(EulerBucket._cache.values()))
    assert bucket._src and not bucket._changed(list(bucket._src))  # nothing moved since
    with torch.no_grad():
        slots[0].head.out.bias.add_(0.5)  # in place: its version moves
    moved = again()
    assert float((moved[0] - first[0]).abs().max()) > 0.1 and torch.equal(moved[1], first[1])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None,
                    reason="torch.compile's inductor needs a C compiler (gcc, or $CC) on PATH")
def test_compiled_euler_loop_equals_serial(base: BaseModel, fast: BaseModel) -> None:
    """EulerOptions(compile=True): the layer math compiled by inductor samples what the serial
    (plain, uncompiled) path samples, within 1e-5 in fp32 (a compile: ~15 s of CPU)."""
    EulerBucket._cache.clear()
    set_euler_options(EulerOptions(compile=True))
    try:
        slots = make_slots(fast)
        acts = predict(fast, list(zip(slots, vlas_for(base, slots))), grouped=True)
    finally:
        set_euler_options(EulerOptions())
        EulerBucket._cache.clear()
    serial = make_slots(base)
    refs = predict(base, list(zip(serial, vlas_for(base, serial))), grouped=False)
    for i, (a, r) in enumerate(zip(acts, refs, strict=True)):
        assert rel(a, r) < TOL, (i, rel(a, r))
