"""LoRA rows on the fast engine (models/fast.py with models/lora.py's `AdapterPool`): an inference
group mixing adapters of different ranks and target modules with frozen-base rows runs the fast
encoder (per-row adapter index tensor, stacked pool weights, gather + bmm deltas) and gives what
the plain segmented forward gives, grouped and per tenant (CPU fp32, 1e-5), in the plain and the
fused decoder layer; frozen rows are bit for bit the fast forward without adapters; a weight
sync (`load_params`) reaches the next forward; the pool's capacity bounds what it holds. A
training step of such a group on the engine gives the plain path's losses and gradients."""

from __future__ import annotations

import gc
import shutil
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models import BaseConfig, BaseModel, SchemaError, TenantSlot
from models.fast import FastQwen3VLEncoder
from models.features import VLABatch
from models.group import encode_grouped, encode_serial, forward_backward
from models.lora import AdapterConfig, router_for
from models.testing import calvin_schema, libero_schema, random_batch
from tests.models.grouping import assert_losses_match, rel, start_adapters_off_zero

torch.set_num_threads(1)

TOL = 1e-5
# (schema, adapter): two ranks and a third, attention and MLP targets, frozen rows in between.
TENANTS = [
    (libero_schema(), AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))),
    (libero_schema(), None),
    (libero_schema(), AdapterConfig(rank=8, target_modules=("q_proj", "k_proj", "o_proj", "down_proj"))),
    (calvin_schema(), AdapterConfig(rank=2, alpha=4.0, target_modules=("gate_proj", "up_proj"))),
    (libero_schema(), None),
]


@pytest.fixture(scope="module")
def fast() -> BaseModel:
    return BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True, lora_pool=4))


def make_slots(base: BaseModel, tenants=TENANTS, seed0: int = 40) -> list[TenantSlot]:
    return start_adapters_off_zero([
        TenantSlot.create(f"t{i}", schema, base, head_options={"width": 32}, seed=seed0 + i, adapter=a)
        for i, (schema, a) in enumerate(tenants)])


def vlas_for(slots: list[TenantSlot], step: int = 0) -> list:
    return [random_batch(s.preprocessor, 2, seed=100 * i + step).features for i, s in enumerate(slots)]


def assert_same(outs, refs, tol: float = TOL) -> None:
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert torch.equal(o.mask_B_L, r.mask_B_L), i
        m = r.mask_B_L
        diff = float((o.hidden_B_L_D[m] - r.hidden_B_L_D[m]).abs().max())
        assert diff <= tol, (i, diff)


@pytest.mark.parametrize("fused", [False, True])
def test_fast_lora_group_equals_plain_and_serial(base: BaseModel, fast: BaseModel, fused: bool) -> None:
    engine = fast._fast
    if fused:
        fast._fast = FastQwen3VLEncoder(fast, fused=True)
    try:
        check_group(base, fast)
    finally:
        fast._fast = engine


def check_group(base: BaseModel, fast: BaseModel) -> None:
    plain_slots, fast_slots = make_slots(base), make_slots(fast)
    vlas = vlas_for(plain_slots)
    router = router_for(fast)
    calls = router.calls
    grouped = encode_grouped(fast, vlas, slots=fast_slots, inference=True)
    serial = encode_serial(fast, vlas, slots=fast_slots, inference=True)
    assert router.calls == calls  # no segmented hook ran: the deltas were the fast engine's
    pool = fast._fast.lora_pool
    assert pool is not None and pool.rank == 8
    ref_grouped = encode_grouped(base, vlas, slots=plain_slots, inference=True)
    ref_serial = encode_serial(base, vlas, slots=plain_slots, inference=True)
    assert_same(grouped, ref_grouped)
    assert_same(serial, ref_serial)
    assert_same(grouped, serial)
    # The adapters do change their own rows (else the above could not fail).
    assert rel(grouped[0].hidden_B_L_D, encode_serial(base, [vlas[0]], inference=True)[0].hidden_B_L_D) > 1e-4
    # Frozen rows get exact zeros: the same packed batch through the engine without adapters.
    with torch.inference_mode():
        frozen, _ = fast._fast(VLABatch.cat(vlas))
    assert torch.equal(grouped[1].hidden_B_L_D, frozen[2:4]) and torch.equal(grouped[4].hidden_B_L_D, frozen[8:10])
    # A group without adapters is the plain fast forward, untouched.
    alone = encode_grouped(fast, [vlas[1]], slots=[fast_slots[1]], inference=True)[0]
    with torch.inference_mode():
        assert torch.equal(alone.hidden_B_L_D, fast._fast(vlas[1])[0])


def test_weight_sync_reaches_the_next_forward(base: BaseModel, fast: BaseModel) -> None:
    plain_slots, fast_slots = make_slots(base), make_slots(fast)
    vlas = vlas_for(plain_slots, 1)
    pool_of = lambda: fast._fast.lora_pool  # noqa: E731
    encode_grouped(fast, vlas, slots=fast_slots, inference=True)
    copies = pool_of().copies
    encode_grouped(fast, vlas, slots=fast_slots, inference=True)
    assert pool_of().copies == copies  # unchanged weights are not copied again
    # The inferencer's weight sync: a new version's export loaded into the serving slot.
    trained = make_slots(base, seed0=90)[2]
    assert not torch.equal(trained.adapter.lora_A[0], fast_slots[2].adapter.lora_A[0])
    blob = trained.export_params()
    fast_slots[2].load_params(blob, strict_schema=False)
    plain_slots[2].load_params(blob, strict_schema=False)
    out = encode_grouped(fast, vlas, slots=fast_slots, inference=True)
    assert pool_of().copies == copies + 1  # only the changed adapter
    assert_same(out, encode_grouped(base, vlas, slots=plain_slots, inference=True))
    # An in-place write (an optimizer step, a test's normal_) is seen too.
    with torch.no_grad():
        for s in (fast_slots[0], plain_slots[0]):
            s.adapter.lora_B[0].add_(0.25)
    assert_same(encode_grouped(fast, vlas, slots=fast_slots, inference=True),
                encode_grouped(base, vlas, slots=plain_slots, inference=True))


def test_pool_capacity_evicts_idle_adapters_and_falls_back_when_a_group_needs_more(base: BaseModel) -> None:
    with pytest.raises(SchemaError, match="lora_pool"):
        BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True, lora_pool=0)
    small = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True, lora_pool=2))
    r4 = AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    tenants = [(libero_schema(), r4)] * 3 + [(libero_schema(), AdapterConfig(rank=16, target_modules=("v_proj",)))]
    fast_slots, plain_slots = make_slots(small, tenants), make_slots(base, tenants)
    vlas = vlas_for(plain_slots, 2)
    router = router_for(small)
    # Three adapters in one group, two pool places: the plain segmented forward, still correct.
    calls = router.calls
    out = encode_grouped(small, vlas[:3], slots=fast_slots[:3], inference=True)
    pool = small._fast.lora_pool
    assert pool.fallbacks == 1 and router.calls > calls
    assert_same(out, encode_grouped(base, vlas[:3], slots=plain_slots[:3], inference=True))
    # Two at a time fit; a third evicts the least recently used one, which comes back on its next use.
    for pair in ((0, 1), (1, 2), (0, 2), (0, 3)):
        calls = router.calls
        out = encode_grouped(small, [vlas[i] for i in pair], slots=[fast_slots[i] for i in pair], inference=True)
        assert router.calls == calls, pair
        assert_same(out, encode_grouped(base, [vlas[i] for i in pair], slots=[plain_slots[i] for i in pair],
                                        inference=True))
    assert pool.fallbacks == 1 and len(pool._entries) == 2
    assert pool.rank == 16  # a higher rank reallocated the pool (a new generation, new graphs on CUDA)
    # A dropped slot's adapter frees its place.
    del fast_slots[3], out
    gc.collect()
    encode_grouped(small, [vlas[1]], slots=[fast_slots[1]], inference=True)
    assert len(pool._entries) == 2 and all(e.ref() is not None for e in pool._entries.values())


def train_items(slots: list[TenantSlot], step: int = 3) -> list:
    return [(s, random_batch(s.preprocessor, 2, seed=100 * i + step)) for i, s in enumerate(slots)]


def grads(slots: list[TenantSlot]) -> list[torch.Tensor]:
    """Every trainable parameter's gradient, adapters and heads, in a fixed order (zeros where none)."""
    out = []
    for s in slots:
        for _, p in s.named_trainable():
            out.append(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
    return out


def check_training_step(base: BaseModel, fast: BaseModel, tol: float = TOL) -> None:
    """One `forward_backward` of the mixed group on the fast engine (grouped and serial) against
    the plain segmented path: the same losses, and the same gradient on every adapter's A and B
    and every head (relative to the gradient's norm), with no segmented hook running."""
    plain_slots, fast_slots = make_slots(base), make_slots(fast)
    router = router_for(fast)
    calls = router.calls
    losses = [r.loss for r in forward_backward(fast, train_items(fast_slots), grouped=True)]
    got = grads(fast_slots)
    assert router.calls == calls  # the engine's deltas, not the hooks
    ref_losses = [r.loss for r in forward_backward(base, train_items(plain_slots), grouped=True)]
    ref = grads(plain_slots)
    assert_losses_match(losses, ref_losses, tol, "fast vs plain")
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert float((g - r).abs().max()) <= tol * max(1.0, float(r.abs().max())), (i, float((g - r).abs().max()))
    # Every adapter got a gradient of its own (else the comparison could pass on zeros) ...
    for s in fast_slots:
        if s.adapter is not None:
            assert all(float(a.grad.abs().max()) > 0 for a in s.adapter.lora_A)
            assert all(float(b.grad.abs().max()) > 0 for b in s.adapter.lora_B)
    assert all(p.grad is None for p in fast.core.parameters())  # ... and the base none
    serial_losses = [r.loss for r in forward_backward(fast, train_items(fast_slots), grouped=False)]
    assert_losses_match(serial_losses, losses, tol, "serial vs grouped")
    for i, (g, r) in enumerate(zip(grads(fast_slots), got)):
        assert float((g - r).abs().max()) <= tol * max(1.0, float(r.abs().max())), ("serial", i)


def test_training_step_on_the_engine_gives_the_plain_gradients(base: BaseModel, fast: BaseModel) -> None:
    check_training_step(base, fast)


def test_expert_and_lora_rows_train_on_the_engine(base: BaseModel, fast: BaseModel) -> None:
    """An action expert with a LoRA adapter reads the prefix cache of the engine's training
    forward (`train_forward(kv=True)`): the same losses and gradients as the plain path."""
    specs = [(libero_schema(), "expert", AdapterConfig(rank=4, target_modules=("q_proj", "v_proj"))),
             (calvin_schema(), "mlp", AdapterConfig(rank=2, target_modules=("k_proj",))),
             (libero_schema(), "expert", None)]

    def run(b: BaseModel) -> tuple[list[float], list[torch.Tensor]]:
        slots = start_adapters_off_zero([TenantSlot.create(f"x{i}", schema, b, head_kind=kind,
                                                           head_options={"width": 32}, seed=5 + i, adapter=a)
                                         for i, (schema, kind, a) in enumerate(specs)])
        losses = [r.loss for r in forward_backward(b, train_items(slots), grouped=True)]
        return losses, grads(slots)

    calls = router_for(fast).calls
    got_l, got = run(fast)
    assert router_for(fast).calls == calls
    ref_l, ref = run(base)
    assert_losses_match(got_l, ref_l, TOL, "expert + LoRA")
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert float((g - r).abs().max()) <= TOL * max(1.0, float(r.abs().max())), i


def test_training_with_dropout_keeps_the_segmented_hooks(fast: BaseModel) -> None:
    """Dropout masks are drawn per segment by the hooks (grouped == serial); the engine has no
    dropout, so such a group takes the plain forward, and its gradients still reach the adapters."""
    tenants = [(libero_schema(), AdapterConfig(rank=4, target_modules=("q_proj",), dropout=0.1)), TENANTS[0]]
    slots = make_slots(fast, tenants)
    router = router_for(fast)
    calls = router.calls
    forward_backward(fast, train_items(slots), grouped=True)
    assert router.calls > calls
    assert all(a.grad is not None and float(a.grad.abs().max()) > 0 for s in slots for a in s.adapter.lora_A)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None,
                    reason="torch.compile's inductor needs a C compiler (gcc, or $CC) on PATH")
def test_compiled_engine_serves_lora_rows(base: BaseModel) -> None:
    """compile=True: the adapted decoder layer is a compiled block too (about a minute of CPU)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True, compile=True))
    plain_slots, slots = make_slots(base), make_slots(compiled)
    vlas = vlas_for(plain_slots, 4)
    calls = router_for(compiled).calls
    out = encode_grouped(compiled, vlas, slots=slots, inference=True)
    assert router_for(compiled).calls == calls
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])
    assert_same(out, encode_grouped(base, vlas, slots=plain_slots, inference=True))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None,
                    reason="torch.compile's inductor needs a C compiler (gcc, or $CC) on PATH")
def test_compiled_engine_trains_lora_rows(base: BaseModel) -> None:
    """compile=True: the training forward runs the compiled blocks (forward and backward) and
    gives the plain path's losses and gradients (a minute or two of CPU)."""
    torch._dynamo.reset()
    compiled = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True, compile=True))
    check_training_step(base, compiled, tol=1e-4)


def test_a_pool_made_under_inference_mode_is_refreshed_outside_it(base: BaseModel) -> None:
    """`predict` wraps the forward in inference_mode; a later no_grad forward (an eval, a trainer's
    prediction) must still refresh the pool in place."""
    fb = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True))
    fast_slots, plain_slots = make_slots(fb), make_slots(base)
    vlas = vlas_for(plain_slots, 5)
    with torch.inference_mode():
        encode_grouped(fb, vlas, slots=fast_slots, inference=True)
    with torch.no_grad():
        for s in (fast_slots[2], plain_slots[2]):
            s.adapter.lora_A[1].mul_(-1.5)
        out = encode_grouped(fb, vlas, slots=fast_slots)
        ref = encode_grouped(base, vlas, slots=plain_slots)
    assert fb._fast.lora_pool.copies == 3 + 1  # three adapters, then the changed one again
    assert_same(out, ref)
