"""No read-only array ever reaches torch (issue 24).

`torch.from_numpy` / `torch.as_tensor` alias a numpy array's memory. A decoded message used to
hold read-only views of the message's ``bytes``; the trainer's first job then logged PyTorch's
"non-writable array" warning: any in-place op on such a tensor writes into memory Python
believes immutable (undefined behaviour). The codec now decodes into owned, writable memory and
the preprocessor copies a caller's state. These tests run the trainer's real path (decode ->
`item_to_batch` -> one training step) with that warning turned into an error.

PyTorch emits this warning once per process (TORCH_WARN_ONCE): `torch.set_warn_always(True)`
makes it fire every time, so an earlier test in the session cannot hide it.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch

from protocol.codec import packb, unpackb
from protocol.messages import QueuePutRequest
from protocol.wire import decode, encode
from tests.support.tq_helpers import micro_batch, tenant


@contextlib.contextmanager
def torch_warnings_are_errors():
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            yield
    finally:
        torch.set_warn_always(was)


def test_the_check_catches_a_read_only_array():
    """The harness itself: a read-only array handed to torch raises inside it (so the tests
    below would fail if one reached torch again)."""
    ro = np.frombuffer(b"\0" * 16, dtype=np.float32)
    with torch_warnings_are_errors(), pytest.raises(UserWarning, match="not writable"):
        torch.from_numpy(ro)
    with torch_warnings_are_errors(), pytest.raises(UserWarning, match="not writable"):
        torch.as_tensor(ro)


def _arrays(obj):
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _arrays(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _arrays(v)


def test_decoded_arrays_own_writable_memory():
    msg = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [np.zeros((2, 2, 3), np.uint8)],
           "s": np.float32(1.5), "e": np.zeros((0, 4), np.int64)}
    data = packb(msg)
    out = unpackb(data)
    arrays = list(_arrays(out))
    assert len(arrays) == 4
    for arr in arrays:
        assert arr.flags.writeable and arr.flags.c_contiguous
    # Writing to a decoded array changes neither the message bytes nor another decode.
    out["a"] += 1
    assert bytes(data) == packb(msg)
    assert np.array_equal(unpackb(data)["a"], msg["a"])


def test_trainer_path_on_decoded_items_hands_torch_no_read_only_array():
    """A queued micro-batch as the trainer gets it (wire bytes -> QueuePutRequest), through
    `item_to_batch` (preprocess, actions, RL fields) and a training step, warnings as errors."""
    from actors.trainer.step import item_to_batch
    from models import BaseConfig, BaseModel, OptimConfig, TenantSchema, TenantSlot, train_step

    cfg = tenant("acme")
    base = BaseModel.load(BaseConfig(source=cfg.base, device="cpu"))
    slot = TenantSlot.create(cfg.name, TenantSchema.from_dict(cfg.schema), base, head_kind=cfg.head,
                             optim=OptimConfig(**cfg.optim), seed=cfg.seed)
    for rl_version in (-1, 0):
        item = decode(encode(micro_batch(cfg, "job-1", 0, b=3, rl_version=rl_version)), QueuePutRequest)
        assert all(a.flags.writeable for a in _arrays([item.images, item.state, item.actions]))
        with torch_warnings_are_errors():
            batch = item_to_batch(slot, item)
            train_step(base, [(slot, batch)], grouped=True)


def test_preprocess_copies_a_read_only_state():
    """A caller's observation may hold read-only arrays (pyarrow, np.frombuffer, a decoded
    message of an older codec): the preprocessor never aliases them into a tensor."""
    from models import BaseConfig, BaseModel
    from models.preprocess import Observation, TenantPreprocessor
    from models.schema import TenantSchema

    cfg = tenant("acme")
    schema = TenantSchema.from_dict(cfg.schema)
    base = BaseModel.load(BaseConfig(source=cfg.base, device="cpu"))
    pre = TenantPreprocessor.for_base(schema, base)
    state = np.frombuffer(np.arange(8, dtype=np.float32).tobytes(), dtype=np.float32)
    frame = np.frombuffer(bytes(16 * 16 * 3), dtype=np.uint8).reshape(16, 16, 3)
    assert not state.flags.writeable and not frame.flags.writeable
    obs = Observation(images={"agentview": frame, "wrist": None}, state=state, instruction="open the drawer")
    with torch_warnings_are_errors():
        batch = pre([obs])
    assert torch.equal(batch.state_B_D[0, :8], torch.arange(8, dtype=torch.float32))


def test_restored_optimizer_state_owns_its_memory():
    """safetensors loads each tensor as a view of a Python bytearray; a restored slot's AdamW
    moments and step were such views, written in place by every later step from the training
    thread. Now every optimizer tensor of a restored slot owns torch-allocated memory (a view
    of a Python buffer has a storage that cannot be resized), and training goes on as before."""
    from actors.trainer.step import item_to_batch
    from models import BaseConfig, BaseModel, OptimConfig, TenantSchema, TenantSlot, train_step
    from models.serialization import FORMAT_CHECKPOINT, load

    cfg = tenant("acme")
    base = BaseModel.load(BaseConfig(source=cfg.base, device="cpu"))

    def new_slot():
        return TenantSlot.create(cfg.name, TenantSchema.from_dict(cfg.schema), base, head_kind=cfg.head,
                                 optim=OptimConfig(**cfg.optim), seed=cfg.seed)

    a = new_slot()
    train_step(base, [(a, item_to_batch(a, micro_batch(cfg, "j", 0)))], grouped=True)
    blob = a.checkpoint()
    b = new_slot()
    b.restore(blob)
    state = [v for st in b.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    assert state and all(v.untyped_storage().resizable() for v in state)
    # Both slots step on identically: the restore is exact, and the blob is untouched.
    with torch_warnings_are_errors():
        for s in (a, b):
            train_step(base, [(s, item_to_batch(s, micro_batch(cfg, "j", 1)))], grouped=True)
    assert all(torch.equal(x, y) for x, y in zip(a.head.state_dict().values(), b.head.state_dict().values()))
    # Compared as loaded, not as bytes: safetensors writes its metadata map (a Rust HashMap) in
    # a per-map random order, so two equal checkpoints' headers may differ byte for byte.
    (ta, ma), (tb, mb) = load(a.checkpoint(), FORMAT_CHECKPOINT), load(b.checkpoint(), FORMAT_CHECKPOINT)
    assert ma == mb and set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
