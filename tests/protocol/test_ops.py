"""The op table (protocol/ops.py) is the one place an op is declared: every role's handlers
match it exactly, a role that disagrees with it refuses to start, and no module above
protocol/ spells an op's subject."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from actors.run import load_role
from actors.handlers import check_ops, declared_ops, op
from actors.runtime import Role, RoleConfig
from protocol import ops
from protocol.messages import InfoRequest, JobRef, Ok
from protocol.subjects import ROLES, Names

ROOT = Path(__file__).resolve().parents[2]


def _serving_class(role_cls: type, handler_name: str) -> type:
    """The class of ``role_cls``'s MRO, or of one of its parts' MROs, that defines the handler."""
    classes = (*role_cls.__mro__, *(k for part in role_cls.part_types for k in part.__mro__))
    return next(k for k in classes if handler_name in vars(k))


def test_every_handler_is_in_the_table_and_every_op_has_one_handler():
    served: dict[tuple[str, str], set[type]] = {}
    for role in ROLES:
        cls = load_role(role)
        table = check_ops(cls)  # raises on any mismatch
        for name, spec in declared_ops(cls).items():
            served.setdefault((spec.op.role, name), set()).add(_serving_class(cls, spec.handler_name))
        assert set(table) == set(declared_ops(cls))
    declared = {(o.role, o.name) for o in ops.ALL_OPS}
    assert set(served) == declared, (set(served) ^ declared)
    many = {k: v for k, v in served.items() if len(v) != 1}
    assert not many, f"ops served by more than one handler class: {many}"
    # The ops of every role are served once, by the runtime itself.
    assert served[("*", "info")] == {Role} and served[("*", "drain")] == {Role}


def test_subjects_and_access_are_the_wire_ones():
    n = Names("nx")
    assert ops.MASTER_LEASE.subject(n) == "nx.master.lease"
    assert ops.ENV_STEP.instance_subject(n, "w1") == "nx.svc.env.w1.step"
    assert ops.INFO.of("trainer").subject(n) == "nx.trainer.info"
    assert ops.INFO.instance_pattern(n) == "nx.svc.*.*.info"
    assert ops.ENV_STOP_WORKFLOW.instance_pattern(n) == "nx.svc.env.*.stop_workflow"
    for o in ops.ALL_OPS:
        assert o.access in ops.ACCESS_LEVELS
        if o.role != ops.EVERY_ROLE:
            assert o.subject(n) == n.role_op(o.role, o.name)
    with pytest.raises(ValueError, match="every role"):
        ops.INFO.subject(n)
    with pytest.raises(ValueError, match="belongs to 'master' alone"):
        ops.MASTER_LEASE.of("trainer")
    with pytest.raises(ValueError, match="access"):
        ops.Op("x", "y", InfoRequest, Ok, "everyone")


def test_a_role_that_disagrees_with_the_table_refuses_to_start(tmp_path):
    stray = ops.Op("health", "stray", JobRef, Ok)

    class Extra(load_role("health")):
        @op(stray)
        async def stray_op(self, req: JobRef) -> Ok:
            return Ok()

    with pytest.raises(TypeError, match=r"handler stray_op serves health\.stray, which is not an op of role 'health'"):
        check_ops(Extra)
    with pytest.raises(TypeError, match="does not match its op table"):
        Extra(RoleConfig(data_dir=tmp_path, instance="x1"))

    class Missing(Role):
        name = "monitor"  # the monitor's table ops, with none of its handlers

    with pytest.raises(TypeError, match=r"op monitor\.snapshot of the table has no handler.*op monitor\.status"):
        check_ops(Missing)

    class Wrong(Role):
        name = "health"

        @op(ops.MASTER_JOB)  # another role's op
        async def job(self, req: JobRef) -> Ok:
            return Ok()

    with pytest.raises(TypeError, match=r"master\.job, which is not an op of role 'health'"):
        check_ops(Wrong)
    with pytest.raises(TypeError, match="@op takes an op of protocol.ops"):
        op("lease")  # the old spelling


# Names' methods that build an op's subject from its name.
_SUBJECT_METHODS = {"master": 0, "env": 0, "role_op": 1, "instance_op": 2}


def test_no_module_above_protocol_spells_an_op_subject():
    found = []
    for pkg in ("transport", "actors", "master", "sdk", "workflows", "bench", "deploy"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                at = _SUBJECT_METHODS.get(node.func.attr)
                if at is None or len(node.args) <= at:
                    continue
                arg = node.args[at]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.func.attr}({arg.value!r})")
    assert not found, "op subjects spelled outside protocol/ops.py (use ops.X.subject(names) or bus.call):\n" \
        + "\n".join(found)
