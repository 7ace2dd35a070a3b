"""In-process learning probe: does a tenant head on the frozen tiny base learn builtin/reach-v0?

Uses only the public APIs of `models` (TenantSchema, TenantSlot.create, OptimConfig, train_step,
predict, slot.preprocessor, the gaussian head's act / PPO loss) and `envs` (make, make_expert,
rollout baselines, LeRobot record + reader). No NATS: this is what the trainer / inferencer /
env worker must reproduce, run in one process.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.learning_probe --algo sft --head mlp --steps 3000
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.learning_probe --algo ppo --head gaussian --steps 30
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.learning_probe --algo baselines

SFT: record `--episodes` scripted-expert demos as a LeRobot dataset (PNG frames by default:
lossless; `--video` for AV1 like `nexus dataset record`), read every frame back with
LeRobotReader, build action-chunk targets (actions t..t+H-1 of the same episode, zero-padded
past the episode end: the expert stops at success), then `--steps` train_step calls on
uniformly sampled minibatches.

PPO (`--steps` = PPO updates): `--envs` envs in lockstep, `--rollout` decisions each per update;
one decision = one head.act on a base forward, then the env steps through the first
`--exec-steps` actions of the sampled chunk (clipped to [-1, 1]); the decision's reward is the
sum of the env rewards it collected. GAE (see `gae`) on decisions; advantages normalised per
update; `--epochs` x `--minibatches` train_step calls per update with TenantBatch RL fields.

Evaluation (`evaluate`): `--eval-episodes` episodes with reset seeds 100000+i (disjoint from
training seeds), deterministic policy (predict = mean / flow from the slot generator), the same
chunk execution rule.

`--cache-features` (default on): the base is frozen, so its features for a given observation are
fixed; they are computed once (SFT: per dataset frame; PPO: at rollout time) and the head's loss
+ slot.optimizer_step run on them. This is the same math as train_step (which recomputes the
base forward every step: pass --no-cache-features to use train_step literally).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import envs
from envs.rollout import evaluate as env_evaluate
from envs.rollout import random_policy, zero_policy
from models import (
    BaseConfig,
    BaseModel,
    BaseOutput,
    CameraSpec,
    Observation,
    OptimConfig,
    TenantBatch,
    TenantSchema,
    TenantSlot,
    VLABatch,
    predict,
    train_step,
)

ENV_ID = "builtin/reach-v0"
EVAL_SEED = 100_000


# ---- GAE ---------------------------------------------------------------------------------
def gae(rewards_T_N: np.ndarray, values_T_N: np.ndarray, dones_T_N: np.ndarray, last_values_N: np.ndarray,
        gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over a (T, N) rollout of N lockstep envs.

    rewards_T_N[t]: reward of decision t; for a decision that ended in *truncation* the caller has
      already added gamma * V(final obs) (time-limit bootstrap), so truncation counts as done here.
    values_T_N[t]: V(obs_t) from the behaviour policy. dones_T_N[t]: the episode ended after
      decision t (terminated or truncated; the env was reset). last_values_N: V(obs_T).
    Returns (advantages_T_N, returns_T_N = advantages + values).
    """
    T = rewards_T_N.shape[0]
    adv = np.zeros_like(rewards_T_N, dtype=np.float32)
    last = np.zeros_like(last_values_N, dtype=np.float32)
    for t in reversed(range(T)):
        next_v = last_values_N if t == T - 1 else values_T_N[t + 1]
        nonterminal = 1.0 - dones_T_N[t].astype(np.float32)
        delta = rewards_T_N[t] + gamma * next_v * nonterminal - values_T_N[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    return adv, adv + values_T_N


# ---- config ------------------------------------------------------------------------------
@dataclass
class ProbeConfig:
    algo: str = "sft"
    base: str = "tiny-qwen3-vl-64"
    base_seed: int = 0
    image_size: int | None = None
    num_query_tokens: int = 8
    head: str = "mlp"
    head_options: dict[str, Any] = field(default_factory=dict)
    cameras: tuple[str, ...] = ("top", "wrist")
    template: str = "{instruction}"
    horizon: int = 1
    exec_steps: int | None = None  # actions executed per decision (default: the whole chunk)
    lr: float = 1e-3
    warmup: int = 50
    batch_size: int = 128
    steps: int = 3000
    seed: int = 0
    episodes: int = 1000  # SFT demos
    video: bool = False
    dataset: str | None = None
    eval_episodes: int = 100
    eval_every: int = 500
    cache_features: bool = True
    demo_noise: float = 0.0  # DART: noise on the executed expert action (labels stay clean)
    # SFT: the evaluations around the training (each costs --eval-episodes episodes); a short
    # guard run (tests/system/test_learning_short.py) skips both.
    initial_eval: bool = True
    reload_check: bool = True
    reward: str = "dense"
    # PPO
    envs: int = 16
    rollout: int = 64
    gamma: float = 0.95
    lam: float = 0.9
    epochs: int = 4
    minibatches: int = 4

    @property
    def k(self) -> int:
        return self.exec_steps or self.horizon


def load_base(cfg: ProbeConfig) -> BaseModel:
    return BaseModel.load(BaseConfig(cfg.base, image_size=cfg.image_size, num_query_tokens=cfg.num_query_tokens,
                                     seed=cfg.base_seed))


def make_slot(cfg: ProbeConfig, base: BaseModel, total_steps: int) -> TenantSlot:
    schema = TenantSchema(cameras=tuple(CameraSpec(c, 64, 64) for c in cfg.cameras), state_dim=4, action_dim=2,
                          action_horizon=cfg.horizon, instruction_template=cfg.template)
    optim = OptimConfig(lr=cfg.lr, warmup_steps=cfg.warmup, total_steps=total_steps)
    return TenantSlot.create("probe", schema, base, head_kind=cfg.head, head_options=cfg.head_options,
                             optim=optim, seed=cfg.seed)


def make_env(cfg: ProbeConfig):
    return envs.make(ENV_ID, reward=cfg.reward)


def to_obs(o, cameras: tuple[str, ...]) -> Observation:
    """Env observation -> model Observation: only the schema's cameras, state as is, raw instruction."""
    return Observation({c: o.images[c] for c in cameras}, o.state, o.instruction)


# ---- evaluation --------------------------------------------------------------------------
def evaluate_slot(cfg: ProbeConfig, base: BaseModel, slot: TenantSlot, episodes: int, seed: int = EVAL_SEED
                  ) -> dict[str, float]:
    """Deterministic policy, `episodes` envs in lockstep (one batched predict per decision)."""
    pool = [make_env(cfg) for _ in range(episodes)]
    obs = [e.reset(seed=seed + i)[0] for i, e in enumerate(pool)]
    active = list(range(episodes))
    success = np.zeros(episodes, bool)
    steps = np.zeros(episodes, int)
    ret = np.zeros(episodes)
    while active:
        vla = slot.preprocessor([to_obs(obs[i], cfg.cameras) for i in active])
        acts = predict(base, [(slot, vla)])[0].float().cpu().numpy()
        still = []
        for j, i in enumerate(active):
            done = False
            for a in acts[j, : cfg.k]:
                o, r, term, trunc, info = pool[i].step(np.clip(a, -1.0, 1.0).astype(np.float32))
                obs[i] = o
                steps[i] += 1
                ret[i] += r
                if term or trunc:
                    done, success[i] = True, bool(info["success"])
                    break
            if not done:
                still.append(i)
        active = still
    return {"success_rate": float(success.mean()), "mean_steps": float(steps.mean()), "mean_return": float(ret.mean())}


def baselines(cfg: ProbeConfig, episodes: int) -> dict[str, dict[str, float]]:
    env = make_env(cfg)
    out = {}
    for name, pol in [("zero", zero_policy(2)), ("random", random_policy(env, seed=0))]:
        rep = env_evaluate(env, pol, episodes=episodes, seed=EVAL_SEED)
        out[name] = {"success_rate": rep.success_rate, "mean_return": rep.mean_return, "mean_steps": rep.mean_steps}
    return out


# ---- SFT ---------------------------------------------------------------------------------
def load_demos(cfg: ProbeConfig) -> tuple[list[Observation], np.ndarray, dict[str, float]]:
    """Record (or open) a LeRobot dataset; every frame as (Observation, action chunk target)."""
    from envs.lerobot import LeRobotReader, RecordConfig, record

    t0 = time.perf_counter()
    tmp = None
    root = cfg.dataset
    if root is None or not (Path(root) / "meta" / "info.json").is_file():
        if root is None:
            tmp = tempfile.TemporaryDirectory(prefix="probe_demos_")
            root = str(Path(tmp.name) / "ds")
        record(RecordConfig(out=root, episodes=cfg.episodes, seed=cfg.seed * 1_000_000, use_videos=cfg.video,
                            action_noise=cfg.demo_noise,
                            overwrite=True))
    t_rec = time.perf_counter() - t0
    with LeRobotReader(root) as ds:
        b = ds.get_batch(np.arange(len(ds)))
    t_read = time.perf_counter() - t0 - t_rec
    if tmp is not None:
        tmp.cleanup()
    n = len(b.index_B)
    obs = [Observation({c: b.images[f"observation.images.{c}"][i] for c in cfg.cameras}, b.state_B_S[i], b.task_B[i])
           for i in range(n)]
    # chunk targets: actions t..t+H-1 of the same episode, zeros past the end (the expert stopped at success)
    act = b.action_B_A.astype(np.float32)
    ep = b.episode_index_B
    tgt = np.zeros((n, cfg.horizon, act.shape[1]), np.float32)
    for h in range(cfg.horizon):
        j = np.arange(n) + h
        ok = j < n
        ok[ok] &= ep[j[ok]] == ep[ok]
        tgt[ok, h] = act[j[ok]]
    return obs, tgt, {"record_s": t_rec, "read_s": t_read, "frames": n}


def run_sft(cfg: ProbeConfig, log) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    base = load_base(cfg)
    slot = make_slot(cfg, base, cfg.steps)
    t_all = time.perf_counter()
    obs, tgt, data_info = load_demos(cfg)
    log(f"demos: {data_info['frames']} frames from {cfg.episodes} episodes "
        f"(record {data_info['record_s']:.1f}s, read {data_info['read_s']:.1f}s)")
    t0 = time.perf_counter()
    vla_all = slot.preprocessor(obs)
    feats_all = None
    if cfg.cache_features:
        parts = [base.encode(vla_all.index(slice(i, i + 512))) for i in range(0, len(obs), 512)]
        feats_all = BaseOutput(torch.cat([p.hidden_B_L_D for p in parts]), torch.cat([p.mask_B_L for p in parts]),
                               parts[0].num_queries)
    t_prep = time.perf_counter() - t0
    log(f"preprocess{' + base features' if cfg.cache_features else ''}: {t_prep:.1f}s")
    tgt_t = torch.from_numpy(tgt)
    g = torch.Generator().manual_seed(cfg.seed)
    curve = []
    init = evaluate_slot(cfg, base, slot, cfg.eval_episodes) if cfg.initial_eval else None
    log(f"{'step':>6} {'loss':>9} {'success':>8} {'steps':>6} {'wall_s':>7}")
    if init is not None:
        curve.append({"step": 0, "loss": None, **init, "wall_s": time.perf_counter() - t_all})
        log(f"{0:>6} {'-':>9} {init['success_rate']:>8.2f} {init['mean_steps']:>6.1f} {curve[-1]['wall_s']:>7.1f}")
    train_s = 0.0
    losses = []
    for step in range(1, cfg.steps + 1):
        t1 = time.perf_counter()
        idx = torch.randint(len(obs), (cfg.batch_size,), generator=g)
        vla = vla_all.index(idx)
        batch = TenantBatch(vla, tgt_t[idx])
        if feats_all is not None:
            slot.zero_grad()
            out = slot.head.loss(BaseOutput(feats_all.hidden_B_L_D[idx], feats_all.mask_B_L[idx], feats_all.num_queries),
                                 batch, slot.generator)
            out.loss.backward()
            slot.optimizer_step()
            losses.append(float(out.loss.detach()))
        else:
            losses.append(train_step(base, [(slot, batch)])[0].loss)
        train_s += time.perf_counter() - t1
        if step % cfg.eval_every == 0 or step == cfg.steps:
            ev = evaluate_slot(cfg, base, slot, cfg.eval_episodes)
            loss = float(np.mean(losses[-50:]))
            curve.append({"step": step, "loss": loss, **ev, "wall_s": time.perf_counter() - t_all})
            log(f"{step:>6} {loss:>9.4f} {ev['success_rate']:>8.2f} {ev['mean_steps']:>6.1f} {curve[-1]['wall_s']:>7.1f}")
    # (c) reproduce: export, load into a fresh slot, re-evaluate
    repro = None
    if cfg.reload_check:
        fresh = make_slot(cfg, base, cfg.steps)
        fresh.load_params(slot.export_params())
        repro = evaluate_slot(cfg, base, fresh, cfg.eval_episodes)
        log(f"reload of exported params: success {repro['success_rate']:.2f} "
            f"(trained slot: {curve[-1]['success_rate']:.2f})")
    return {"curve": curve, "initial": init, "final": curve[-1], "reloaded": repro, "data": data_info,
            "train_s": train_s, "prep_s": t_prep, "wall_s": time.perf_counter() - t_all}


# ---- PPO ---------------------------------------------------------------------------------
def run_ppo(cfg: ProbeConfig, log) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    base = load_base(cfg)
    if cfg.head != "gaussian":
        raise SystemExit("ppo needs --head gaussian (act / log_prob / value)")
    total_mb = cfg.steps * cfg.epochs * cfg.minibatches
    slot = make_slot(cfg, base, total_mb)
    head = slot.head
    t_all = time.perf_counter()
    pool = [make_env(cfg) for _ in range(cfg.envs)]
    ep_seed = cfg.seed * 1_000_000
    obs = []
    for e in pool:
        obs.append(e.reset(seed=ep_seed)[0])
        ep_seed += 1
    init = evaluate_slot(cfg, base, slot, cfg.eval_episodes)
    curve = [{"update": 0, "env_steps": 0, "loss": None, **init, "wall_s": time.perf_counter() - t_all}]
    log(f"{'update':>6} {'env_steps':>9} {'loss':>9} {'success':>8} {'steps':>6} {'train_succ':>10} {'wall_s':>7}")
    log(f"{0:>6} {0:>9} {'-':>9} {init['success_rate']:>8.2f} {init['mean_steps']:>6.1f} {'-':>10} {curve[-1]['wall_s']:>7.1f}")
    env_steps = 0
    N, T = cfg.envs, cfg.rollout
    for update in range(1, cfg.steps + 1):
        vlas, feats, acts, logps, vals = [], [], [], [], []
        rew = np.zeros((T, N), np.float32)
        dones = np.zeros((T, N), bool)
        ep_done = ep_succ = 0
        for t in range(T):
            vla = slot.preprocessor([to_obs(o, cfg.cameras) for o in obs])
            with torch.no_grad():
                f = base.encode(vla)
                a, lp, v = head.act(f, vla, slot.generator)
            vlas.append(vla)
            feats.append(f)
            acts.append(a)
            logps.append(lp)
            vals.append(v)
            a_np = a.numpy()
            trunc_idx = []
            for i, e in enumerate(pool):
                for k in range(cfg.k):
                    o, r, term, trunc, info = e.step(np.clip(a_np[i, k], -1.0, 1.0).astype(np.float32))
                    env_steps += 1
                    rew[t, i] += r
                    if term or trunc:
                        break
                obs[i] = o
                if term or trunc:
                    dones[t, i] = True
                    ep_done += 1
                    ep_succ += bool(info["success"])
                    if trunc:
                        trunc_idx.append((i, o))
                    obs[i] = e.reset(seed=ep_seed)[0]
                    ep_seed += 1
            if trunc_idx:  # time-limit bootstrap: + gamma * V(final obs)
                tv = slot.preprocessor([to_obs(o, cfg.cameras) for _, o in trunc_idx])
                with torch.no_grad():
                    _, _, vt = head.act(base.encode(tv), tv, torch.Generator().manual_seed(0), deterministic=True)
                for (i, _), val in zip(trunc_idx, vt.numpy()):
                    rew[t, i] += cfg.gamma * float(val)
        vla = slot.preprocessor([to_obs(o, cfg.cameras) for o in obs])
        with torch.no_grad():
            _, _, last_v = head.act(base.encode(vla), vla, torch.Generator().manual_seed(0), deterministic=True)
        values = torch.stack(vals).numpy()
        adv, ret = gae(rew, values, dones, last_v.numpy(), cfg.gamma, cfg.lam)
        # flatten (T, N) -> B
        B = T * N
        vla_b = VLABatch.cat(vlas)
        hid = torch.cat([f.hidden_B_L_D for f in feats])
        msk = torch.cat([f.mask_B_L for f in feats])
        act_b = torch.cat(acts)
        logp_b = torch.cat(logps)
        adv_b = torch.from_numpy(adv.reshape(B))
        adv_b = (adv_b - adv_b.mean()) / (adv_b.std() + 1e-8)
        ret_b = torch.from_numpy(ret.reshape(B)).float()
        g = torch.Generator().manual_seed(cfg.seed * 7919 + update)
        mb = B // cfg.minibatches
        metrics = []
        for _ in range(cfg.epochs):
            perm = torch.randperm(B, generator=g)
            for m in range(cfg.minibatches):
                idx = perm[m * mb:(m + 1) * mb]
                batch = TenantBatch(vla_b.index(idx), act_b[idx], logp_b[idx], adv_b[idx], ret_b[idx])
                if cfg.cache_features:
                    slot.zero_grad()
                    out = head.loss(BaseOutput(hid[idx], msk[idx], feats[0].num_queries), batch, slot.generator)
                    out.loss.backward()
                    slot.optimizer_step()
                    metrics.append({"loss": float(out.loss.detach()), **out.metrics})
                else:
                    r = train_step(base, [(slot, batch)])[0]
                    metrics.append({"loss": r.loss, **r.metrics})
        loss = float(np.mean([m["loss"] for m in metrics]))
        row = {"update": update, "env_steps": env_steps, "loss": loss,
               "train_success": ep_succ / max(ep_done, 1), "train_episodes": ep_done,
               "approx_kl": float(np.mean([m["approx_kl"] for m in metrics])),
               "entropy": metrics[-1]["entropy"], "value_loss": float(np.mean([m["value_loss"] for m in metrics]))}
        if update % cfg.eval_every == 0 or update == cfg.steps:
            row.update(evaluate_slot(cfg, base, slot, cfg.eval_episodes))
        row["wall_s"] = time.perf_counter() - t_all
        curve.append(row)
        sr = f"{row['success_rate']:>8.2f} {row['mean_steps']:>6.1f}" if "success_rate" in row else f"{'':>8} {'':>6}"
        log(f"{update:>6} {env_steps:>9} {loss:>9.4f} {sr} {row['train_success']:>10.2f} {row['wall_s']:>7.1f}")
    evals = [r for r in curve if "success_rate" in r]
    return {"curve": curve, "initial": init, "final": evals[-1],
            "best": max(evals, key=lambda r: r["success_rate"]),
            "gain_points": 100 * (evals[-1]["success_rate"] - init["success_rate"]),
            "wall_s": time.perf_counter() - t_all}


# ---- CLI -----------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> ProbeConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ProbeConfig()
    p.add_argument("--algo", choices=["sft", "ppo", "baselines"], default=d.algo)
    p.add_argument("--base", default=d.base)
    p.add_argument("--base-seed", type=int, default=d.base_seed)
    p.add_argument("--image-size", type=int, default=None, help="base resolution (frames are resized to it)")
    p.add_argument("--num-query-tokens", type=int, default=d.num_query_tokens)
    p.add_argument("--head", default=d.head, choices=["mlp", "flow", "gaussian"])
    p.add_argument("--head-options", default="{}", help="JSON dict for the head's config dataclass")
    p.add_argument("--cameras", default=",".join(d.cameras))
    p.add_argument("--template", default=d.template)
    p.add_argument("--horizon", type=int, default=d.horizon)
    p.add_argument("--exec-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--steps", type=int, default=d.steps, help="SFT: optimizer steps; PPO: updates")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--episodes", type=int, default=d.episodes, help="SFT demo episodes to record")
    p.add_argument("--video", action="store_true", help="record demos as AV1 video (default PNG)")
    p.add_argument("--dataset", default=None, help="existing LeRobot dataset dir (recorded there if absent)")
    p.add_argument("--eval-episodes", type=int, default=d.eval_episodes)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--no-cache-features", dest="cache_features", action="store_false")
    p.add_argument("--no-initial-eval", dest="initial_eval", action="store_false",
                   help="SFT: skip the evaluation of the untrained head")
    p.add_argument("--no-reload-check", dest="reload_check", action="store_false",
                   help="SFT: skip re-evaluating the exported params in a fresh slot")
    p.add_argument("--demo-noise", type=float, default=d.demo_noise,
                   help="DART: std of noise added to the executed expert action while recording")
    p.add_argument("--reward", default=d.reward, choices=["dense", "sparse"])
    p.add_argument("--envs", type=int, default=d.envs)
    p.add_argument("--rollout", type=int, default=d.rollout)
    p.add_argument("--gamma", type=float, default=d.gamma)
    p.add_argument("--lam", type=float, default=d.lam)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--minibatches", type=int, default=d.minibatches)
    p.add_argument("--json", default=None, help="write config + results here")
    a = vars(p.parse_args(argv))
    json_path = a.pop("json")
    a["head_options"] = json.loads(a["head_options"])
    a["cameras"] = tuple(c for c in a["cameras"].split(",") if c)
    cfg = ProbeConfig(**a)
    cfg.json = json_path  # type: ignore[attr-defined]
    return cfg


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(f"config: {json.dumps({k: v for k, v in asdict(cfg).items()})}")
    if cfg.algo == "sft":
        res = run_sft(cfg, log)
    elif cfg.algo == "ppo":
        res = run_ppo(cfg, log)
    else:
        base = load_base(cfg)
        slot = make_slot(cfg, base, 1)
        res = {"baselines": baselines(cfg, cfg.eval_episodes), "untrained": evaluate_slot(cfg, base, slot, cfg.eval_episodes)}
        log(json.dumps(res, indent=1))
    res["config"] = asdict(cfg)
    if getattr(cfg, "json", None):
        Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json).write_text(json.dumps(res, indent=1, default=str))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
