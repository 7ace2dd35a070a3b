"""Does a spec match the policy it trains or scores? An eval's repeated sections against the
policy's export, a tenant's next workload against its existing slot (`master.workloads`)."""

from __future__ import annotations

from typing import Any

from protocol.messages import TenantConfig


def policy_sections(policy: dict[str, Any]) -> dict[str, Any]:
    """The spec sections (base, action_module, observation, action) of a policy, from its
    export manifest (or its tenant config, which has the same keys), defaults filled in."""
    from master.spec import PPO_HEAD_FIELDS, ActionModuleSpec, ActionSpec, ObservationSpec

    schema = policy["schema"]
    # PPO loss coefficients live in a gaussian head's params (compile_tenant): an eval computes no loss.
    params = {k: v for k, v in dict(policy.get("head_params") or {}).items() if k not in PPO_HEAD_FIELDS}
    return {
        "base": policy["base"],
        "action_module": ActionModuleSpec(kind=policy["head"], params=params).model_dump(mode="json"),
        "observation": ObservationSpec(cameras=schema["cameras"], state_dim=schema["state_dim"],
                                       instruction_template=schema["instruction_template"]).model_dump(mode="json"),
        "action": ActionSpec(dim=schema["action_dim"], horizon=schema["action_horizon"]).model_dump(mode="json"),
    }

def policy_mismatches(spec: Any, sections: dict[str, Any], tenant: str, version: int) -> list[tuple[str, str, Any]]:
    """Each leaf of a section an eval spec repeats that differs from the policy it scores."""
    from master.spec import POLICY_FIELDS
    from protocol.subjects import canonical_base

    which = f"tenant {tenant}'s policy" + (f" version {version}" if version >= 0 else "")
    errors: list[tuple[str, str, Any]] = []
    for name in POLICY_FIELDS:
        given = getattr(spec, name)
        if given is None:
            continue
        mine = given if isinstance(given, str) else given.model_dump(mode="json")
        theirs = sections[name]
        if name == "base" and canonical_base(given) == theirs:
            continue  # './my_base' and its absolute path are one base (tenants store the latter)
        pairs = [(name, mine, theirs)] if isinstance(mine, str) else [
            (f"{name}.{k}", mine[k], theirs[k]) for k in mine]
        for path, a, b in pairs:
            if a != b:
                errors.append((path, f"{a!r} differs from {which}: {b!r}; an eval takes {name} from the policy "
                                     "it scores: leave it out", a))
    return errors

# TenantConfig fields a later workload of the same tenant may change: how it is scheduled and
# how it is optimised (the optimizer's moments carry over; its hyper-parameters and the PPO
# loss coefficients are the new workload's). Everything else is what the slot *is*.
MUTABLE_FIELDS = ("priority", "max_inflight_jobs", "sft_prefetch_items", "staleness_bound", "optim", "head_params",
                  "export_every_steps")

def check_same_policy(mine: TenantConfig, target: TenantConfig, same_tenant: bool = False) -> None:
    """An eval scores another tenant's export, and a tenant's next workload trains the same
    slot: its schema and head (and, for the same tenant, base, head options, optimizer and
    seed) must be that policy's."""
    from master.spec import SpecError
    from models.schema import TenantSchema

    who = "this tenant's existing slot" if same_tenant else f"tenant {target.name}'s policy"
    errors: list[tuple[str, str]] = []
    if TenantSchema.from_dict(mine.schema).signature() != target.signature:
        for path, stored, asked in schema_differences(target.schema, mine.schema):
            errors.append((path, f"stored {stored!r} (in {who}), asked {asked!r}"))
        if not errors:  # same fields, other signature (a schema from an older version of the code)
            errors.append(("observation", f"schema differs from {who} (cameras, state_dim, action dim/horizon "
                                          "and template must match)"))
    if mine.head != target.head:
        errors.append(("action_module.kind", f"{mine.head!r}, but {who} uses {target.head!r}"))
    if not same_tenant and mine.base_adapter != target.base_adapter:
        errors.append(("base_adapter", f"{mine.base_adapter or None!r}, but {who} uses "
                                       f"{target.base_adapter or None!r}"))
    if same_tenant:
        from master.spec import PPO_HEAD_FIELDS

        def structure(params: dict[str, Any]) -> dict[str, Any]:  # loss coefficients may change
            return {k: v for k, v in params.items() if k not in PPO_HEAD_FIELDS}

        for name, path, get in (("base", "base", lambda c: c.base), ("seed", "seed", lambda c: c.seed),
                                ("base_adapter", "base_adapter", lambda c: c.base_adapter),
                                ("head_params", "action_module", lambda c: structure(c.head_params))):
            if get(mine) != get(target):
                errors.append((path, f"{get(mine)!r} differs from {who}'s {get(target)!r}"))
        if errors:  # the way out, said once (on the last error): a slot keeps what it is for life
            path, message = errors[-1]
            errors[-1] = (path, f"{message}; a tenant's slot keeps its schema, head and base: `nexus tenant "
                                f"reset {target.name}` drops the slot (its versions and checkpoints; its workload "
                                "records and usage stay) so this spec registers anew, or use another tenant name")
    if errors:
        raise SpecError(errors)

# A stored schema's keys (models.schema.TenantSchema.to_dict) and where a spec sets each.
SCHEMA_SPEC_FIELDS = (("cameras", "observation.cameras"), ("state_dim", "observation.state_dim"),
                      ("instruction_template", "observation.instruction_template"),
                      ("action_dim", "action.dim"), ("action_horizon", "action.horizon"))

def schema_differences(stored: dict[str, Any], asked: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(spec field, stored value, asked value) for each schema field that differs, both read
    canonically (`TenantSchema.to_dict`: cameras as name / height / width)."""
    from models.schema import TenantSchema

    a, b = TenantSchema.from_dict(stored).to_dict(), TenantSchema.from_dict(asked).to_dict()
    return [(path, a[key], b[key]) for key, path in SCHEMA_SPEC_FIELDS if a[key] != b[key]]
