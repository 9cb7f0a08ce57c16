"""Fed-SB (Singhal et al., 2025): R averaged on shared bases is the exact average of the clients' updates;
the initialization round's SVD; the official aggregation; the client's hooks on a peft model; central DP on
R; what a client may send; a run, its uploads and its resume; the refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from torch.testing import assert_close

from fedllm.aggregation import STRATEGIES, ClientUpdate, GlobalState, RoundContext
from fedllm.aggregation.fedsb import CORE, RANK, STEP, FedSB, FedSBCore, FedSBInit
from fedllm.aggregation.server_opt import FedAdam
from fedllm.checks import ClientFailure, Expected
from fedllm.config import ConfigError, load_config
from fedllm.factors import LoraFactors, lora_modules
from fedllm.privacy.strategy import DPStrategy

OUT, IN, RMAX = 12, 10, 8
KEY = "m.q_proj"


def _state(gen) -> GlobalState:
    """Bases with orthonormal columns (B) and rows (A), as the initialization's SVD makes them, and an R."""
    qb, _ = torch.linalg.qr(torch.randn(OUT, RMAX, generator=gen, dtype=torch.float64))
    qa, _ = torch.linalg.qr(torch.randn(IN, RMAX, generator=gen, dtype=torch.float64))
    R = torch.randn(RMAX, RMAX, generator=gen, dtype=torch.float64)
    return GlobalState({KEY: LoraFactors(qa.T.contiguous(), qb, 1.0)}, extras={f"{CORE}{KEY}": R, RANK: RMAX})


def _exp(k: int, rank: int, n: int, asked: dict) -> Expected:
    return Expected(k, n, rank, 2.0, {KEY: (OUT, IN)}, asked=asked, round=2)


def _update(strategy, state, k, rank, n, block) -> ClientUpdate:
    """Client ``k`` of ``rank``'s update, as the server keeps it once accepted: its block put into the R it
    downloaded (checked here against the server's own acceptance, which works in float32; the update keeps
    the test's float64), its factors the bases it downloaded."""
    asked = strategy.client_extras(state, k)
    accepted = strategy.accept_extras({f"{CORE}{KEY}": block}, _exp(k, rank, n, asked))[f"{CORE}{KEY}"]
    full = asked[f"{CORE}{KEY}"].clone()
    full[:rank, :rank] = block
    assert torch.equal(accepted, full.float())
    return ClientUpdate(k, n, strategy.client_factors(state, rank, 2.0, k), extras={f"{CORE}{KEY}": full})


def _product(strategy, state) -> torch.Tensor:
    return strategy.global_adapter(state)[KEY].delta()


def test_averaging_r_is_the_exact_average_of_the_clients_updates(gen):
    """Mixed ranks: each client's model is the global R with its leading block trained; the new global product
    is the weighted sum of those models' products (dense reference), and a block no client trains stays."""
    fedsb = FedSB()
    state = _state(gen)
    ranks, counts = (8, 4, 2), (10, 30, 60)
    blocks = [torch.randn(r, r, generator=gen, dtype=torch.float64) for r in ranks]
    ups = [
        _update(fedsb, state, k, r, n, b)
        for k, (r, n, b) in enumerate(zip(ranks, counts, blocks, strict=True))
    ]
    w = [n / sum(counts) for n in counts]
    f = state.factors[KEY]
    dense = 0
    for p, r, b in zip(w, ranks, blocks, strict=True):
        R = state.extras[f"{CORE}{KEY}"].clone()
        R[:r, :r] = b
        dense = dense + p * (f.B @ R @ f.A)
    new = fedsb.aggregate(ups, state, w).state
    assert_close(_product(fedsb, new), dense, rtol=1e-6, atol=1e-12)
    assert torch.equal(new.factors[KEY].A, f.A) and torch.equal(new.factors[KEY].B, f.B)  # the bases stay
    # only rank-2 clients: the R entries outside the 2 x 2 block are no one's to change
    small = [
        _update(fedsb, state, k, 2, 10, torch.randn(2, 2, generator=gen, dtype=torch.float64)) for k in (0, 1)
    ]
    R0, R1 = state.extras[f"{CORE}{KEY}"], fedsb.aggregate(small, state).state.extras[f"{CORE}{KEY}"]
    outside = torch.ones(RMAX, RMAX, dtype=torch.bool)
    outside[:2, :2] = False
    assert torch.equal(R1[outside], R0[outside]) and not torch.allclose(R1[:2, :2], R0[:2, :2])


def test_initialization_round_takes_the_svd_of_the_average_step(gen):
    """Round 1: the weighted average of the clients' dense steps, truncated to the largest rank by SVD:
    B = U (orthonormal columns), A = V^T (orthonormal rows), R = diag(S); the product is the best rank-r
    approximation of the average step."""
    fedsb = FedSB()
    counts = (10, 30, 60)
    steps = [torch.randn(OUT, IN, generator=gen, dtype=torch.float64) for _ in counts]
    fresh = {KEY: LoraFactors(torch.zeros(RMAX, IN), torch.zeros(OUT, RMAX), 2.0)}
    ups = [
        ClientUpdate(k, n, fresh, extras={f"{STEP}{KEY}": s})
        for k, (n, s) in enumerate(zip(counts, steps, strict=True))
    ]
    ctx = RoundContext(1, 3, [fresh] * 3, RMAX, lambda: fresh)
    new = fedsb.aggregate(ups, GlobalState(), None, ctx).state
    mean = sum(n / sum(counts) * s for n, s in zip(counts, steps, strict=True))
    u, s, vh = torch.linalg.svd(mean, full_matrices=False)
    best = (u[:, :RMAX] * s[:RMAX]) @ vh[:RMAX]
    assert_close(_product(fedsb, new), best, rtol=1e-6, atol=1e-10)
    f = new.factors[KEY]
    assert_close(f.A @ f.A.T, torch.eye(RMAX, dtype=f.A.dtype), rtol=0, atol=1e-10)
    assert_close(f.B.T @ f.B, torch.eye(RMAX, dtype=f.B.dtype), rtol=0, atol=1e-10)
    assert_close(new.extras[f"{CORE}{KEY}"], torch.diag(s[:RMAX]))
    assert not any(k.startswith(STEP) for k in new.extras)  # the steps are not kept (nor sent)
    # round 2's download: the bases' leading directions and R; before the initialization, nothing
    assert fedsb.client_factors(GlobalState(), 4, 2.0, 0) is None
    lead = fedsb.client_factors(new, 4, 2.0, 0)[KEY]
    assert torch.equal(lead.A, f.A[:4]) and torch.equal(lead.B, f.B[:, :4])


def _official_fed_sb_mean(client_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What CERT-Lab/fed-sb's ``aggregate_models_fed_sb`` (fed_sb/fed/fed_agg.py) does to the clients' state
    dicts: every entry whose name holds ``default_lora_latent_mapping`` becomes the plain mean over clients
    (``torch.stack(...).mean(0)``); restated here from reading it, on its state-dict names."""
    out = {}
    for k in client_dicts[0]:
        if "default_lora_latent_mapping" in k:
            out[k] = torch.stack([d[k].float() for d in client_dicts], 0).mean(0)
    return out


def test_equals_the_official_aggregation_on_the_same_arrays(gen):
    fedsb = FedSB()
    state = _state(gen)
    name = "base_model.model.m.q_proj.default_lora_latent_mapping.weight"
    Rs = [torch.randn(RMAX, RMAX, generator=gen) for _ in range(4)]
    f = state.factors[KEY]
    official = _official_fed_sb_mean(
        [{name: R, "base_model.model.m.q_proj.lora_A.default.weight": f.A.float()} for R in Rs]
    )[name]
    ups = [_update(fedsb, state, k, RMAX, 7 * k + 1, R) for k, R in enumerate(Rs)]
    ours = fedsb.aggregate(ups, state, [0.25] * 4).state.extras[
        f"{CORE}{KEY}"
    ]  # aggregation.weighting=uniform
    assert_close(ours.float(), official, rtol=1e-6, atol=1e-7)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(IN, OUT, bias=False)

    def forward(self, x):
        return self.q_proj(x)


def _peft(rank: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_Tiny(), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj"]))
    modules = lora_modules(model, "default")
    return model, modules, next(iter(modules.values()))


def test_the_core_session_trains_r_alone_on_the_bases(gen):
    """y = W0 x + B R A x whatever the layer's LoRA scale; gradients reach R only; closing restores the
    layer."""
    model, modules, layer = _peft(4)
    state = _state(gen)
    f = FedSB().client_factors(state, 4, 2.0, 0)[KEY]
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(f.A)
        layer.lora_B["default"].weight.copy_(f.B)
    R = state.extras[f"{CORE}{KEY}"].float()
    x = torch.randn(5, IN, generator=gen)
    W0 = layer.base_layer.weight.detach()
    session = FedSBCore(model, "default", {next(iter(modules)): R})
    y = model(x)
    expect = x @ W0.T + x @ (f.B.float() @ R[:4, :4] @ f.A.float()).T
    assert_close(y, expect, rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    (core,) = session.shared_params().values()
    assert core.grad is not None and core.grad.abs().sum() > 0
    assert layer.lora_A["default"].weight.grad is None and layer.lora_B["default"].weight.grad is None
    assert torch.equal(session.upload()[f"{CORE}{next(iter(modules))}"], core.detach())
    session.close()
    assert layer.lora_A["default"].weight.requires_grad and layer.lora_B["default"].weight.requires_grad
    plain = x @ W0.T + 2.0 * x @ (f.B.float() @ f.A.float()).T  # the plain LoRA layer again (scale 2)
    assert_close(model(x), plain, rtol=1e-5, atol=1e-6)


def test_the_initialization_session_takes_one_adam_step_of_full_fine_tuning(gen):
    """Its delta's gradient is the base weight's; one AdamW step of the local work it sets is -lr sign(g)."""
    from fedllm.client.base import LocalWork

    model, modules, layer = _peft(4)
    session = FedSBInit(model, "default", init_examples=20, init_lr=1e-3)
    work = session.local_work(LocalWork(round=1, client_id=0, steps=50, seed=0, lr=3e-3, batch_size=8))
    assert (work.steps, work.grad_accum, work.lr, work.scheduler) == (1, 3, 1e-3, "constant")
    assert (work.weight_decay, work.max_grad_norm, work.warmup_ratio) == (0.0, 0.0, 0.0)
    x = torch.randn(6, IN, generator=gen)
    target = torch.randn(6, OUT, generator=gen)
    (delta,) = session.shared_params().values()
    (model(x) - target).square().sum().backward()
    W = layer.base_layer.weight.detach().clone().requires_grad_(True)  # the dense reference
    (x @ W.T - target).square().sum().backward()
    assert_close(delta.grad, W.grad, rtol=1e-5, atol=1e-6)
    torch.optim.AdamW([delta], lr=work.lr, weight_decay=0.0).step()
    up = session.upload()[f"{STEP}{next(iter(modules))}"]
    assert_close(up, -work.lr * torch.sign(W.grad), rtol=1e-4, atol=1e-9)
    session.close()
    assert not layer.lora_A["default"]._forward_pre_hooks and not layer.lora_B["default"]._forward_hooks


def _dp(sigma: float, clip: float = 1.0):
    return DPStrategy(
        FedSB(),
        mode="central",
        clip_norm=clip,
        noise_multiplier=sigma,
        noise_seed=3,
        epsilon_after=lambda r: 0.0,
        summary=lambda r: {},
    )


def test_central_dp_clips_and_noises_r(gen):
    """Each client's change of R (from its download) clipped to C, uniform 1/m over the m sampled clients (one
    failed), noise N(0, (sigma C / m)^2) on R and nothing on the bases; the initialization's steps alike."""
    fedsb = FedSB()
    state = _state(gen)
    R0 = state.extras[f"{CORE}{KEY}"].float()
    state.extras[f"{CORE}{KEY}"] = R0
    state.factors[KEY] = LoraFactors(state.factors[KEY].A.float(), state.factors[KEY].B.float(), 1.0)
    moves = [torch.full((RMAX, RMAX), 0.01), torch.full((RMAX, RMAX), 10.0), torch.zeros(RMAX, RMAX)]
    ups = [_update(fedsb, state, k, RMAX, 10, R0 + d) for k, d in enumerate(moves)]
    refs = [fedsb.client_factors(state, RMAX, 2.0, k) for k in range(3)]
    ctx = RoundContext(2, 4, refs, RMAX, lambda: {})
    quiet = _dp(0.0).aggregate(ups, state, None, ctx).state
    big = moves[1] / moves[1].norm()  # clipped to norm 1
    assert_close(quiet.extras[f"{CORE}{KEY}"], R0 + (moves[0] + big) / 4, rtol=1e-5, atol=1e-6)
    noisy = _dp(2.0).aggregate(ups, state, None, ctx).state
    noise = noisy.extras[f"{CORE}{KEY}"] - quiet.extras[f"{CORE}{KEY}"]
    assert 0.3 < float(noise.std()) < 0.7  # sigma C / m = 0.5 over 64 entries
    assert torch.equal(noisy.factors[KEY].A, state.factors[KEY].A)
    assert torch.equal(noisy.factors[KEY].B, state.factors[KEY].B)
    # the initialization round: the dense steps are clipped and noised the same way, before the SVD
    fresh = {KEY: LoraFactors(torch.zeros(RMAX, IN), torch.zeros(OUT, RMAX), 2.0)}
    steps = [
        ClientUpdate(k, 10, fresh, extras={f"{STEP}{KEY}": torch.full((OUT, IN), 5.0)}) for k in range(2)
    ]
    ctx1 = RoundContext(1, 2, [fresh] * 2, RMAX, lambda: fresh)
    init = _dp(0.0).aggregate(steps, GlobalState(), None, ctx1).state
    clipped = torch.full((OUT, IN), 1.0 / (OUT * IN) ** 0.5)
    u, s, vh = torch.linalg.svd(clipped)
    assert_close(_product(fedsb, init), (u[:, :RMAX] * s[:RMAX]) @ vh[:RMAX], rtol=1e-4, atol=1e-6)


def test_a_server_optimizer_steps_r(gen):
    """FedAdam on Fed-SB: R takes the adaptive step from the average of the clients' R; the bases stay."""
    state = _state(gen)
    R0 = state.extras[f"{CORE}{KEY}"]
    ups = [_update(FedSB(), state, k, RMAX, 10, R0 + 0.5) for k in range(2)]
    refs = [FedSB().client_factors(state, RMAX, 2.0, k) for k in range(2)]
    opt = FedAdam(FedSB())
    new = opt.aggregate(ups, state, None, RoundContext(3, 2, refs, RMAX, lambda: {})).state
    o = opt.opts
    lr = o.eta * (1 - o.beta_2**4) ** 0.5 / (1 - o.beta_1**4)
    delta = torch.full_like(R0, 0.5)
    m, v = (1 - o.beta_1) * delta, (1 - o.beta_2) * delta**2
    assert_close(new.extras[f"{CORE}{KEY}"], R0 + lr * m / (v.sqrt() + o.tau))
    assert torch.equal(new.factors[KEY].A, state.factors[KEY].A)


@pytest.mark.parametrize(
    ("extras", "why"),
    [
        ({f"{CORE}{KEY}": torch.zeros(RMAX, RMAX)}, "shape (8, 8), expected (4, 4)"),
        ({f"{CORE}{KEY}": torch.full((4, 4), float("nan"))}, "non-finite"),
        ({}, "cover 0 modules"),
        ({f"{STEP}{KEY}": torch.zeros(OUT, IN)}, "cover 0 modules"),  # a dense step after the initialization
        ({f"{CORE}{KEY}": torch.zeros(4, 4, dtype=torch.int64)}, "floating-point"),
    ],
)
def test_what_a_client_may_send(gen, extras, why):
    fedsb = FedSB()
    state = _state(gen)
    with pytest.raises(ClientFailure, match=re.escape(why)):
        fedsb.accept_extras(extras, _exp(0, 4, 10, fedsb.client_extras(state, 0)))
    # the initialization round: one dense step per module, at the module's shape
    with pytest.raises(ClientFailure, match=re.escape(f"shape (4, 4), expected ({OUT}, {IN})")):
        fedsb.accept_extras({f"{STEP}{KEY}": torch.zeros(4, 4)}, _exp(0, 4, 10, {}))


@pytest.mark.parametrize(
    ("over", "refused"),
    [
        (["client.algorithm=scaffold"], "needs a strategy that averages parameters"),
        (["client.algorithm=perfedavg"], "take one plain optimizer step in some rounds"),
        (["client.sft.optimizer=sgd"], "client.sft.optimizer=adamw"),
        (["client.algorithm=fedprox", "client.fedprox.optimizer=sgd"], "client.fedprox.optimizer=adamw"),
        (["aggregation.server_opt=fedadam"], None),
        (["privacy.mode=central", "lora.trainable_modules=[]"], None),
        (["aggregation.fedsb.init_examples=0"], "aggregation.fedsb.init_examples"),
        (["comm.download=int8"], "comm.download = int8 would quantize them"),
    ],
)
def test_what_fedsb_refuses_and_accepts(over, refused):
    if refused is None:
        assert load_config(None, ["aggregation.name=fedsb", *over]).aggregation.name == "fedsb"
        return
    with pytest.raises(ConfigError, match=re.escape(refused)):
        load_config(None, ["aggregation.name=fedsb", *over])


def test_a_fedsb_run_uploads_a_dense_step_once_then_r(tmp_path, builtin_base):
    """Round 1 uploads each client's dense step (out x in per module); round 2 on, r_k^2 per module."""
    from conftest import tiny_overrides

    from fedllm.cli import main

    assert (
        main(["run", *tiny_overrides(tmp_path / "r", "aggregation.name=fedsb", "lora.trainable_modules=[]")])
        == 0
    )
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()][1:]
    cfg = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert all(r["n_updates"] == 4 for r in rows)
    ranks = [cfg["lora"]["ranks"][k % len(cfg["lora"]["ranks"])] for k in range(4)]
    modules = rows[1]["up_params"] // sum(r * r for r in ranks)
    assert modules * sum(r * r for r in ranks) == rows[1]["up_params"] and modules > 0
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "r" / "global_adapter" / "adapter_model.safetensors")
    dense = sum(
        t.shape[1] * exported[k.replace("lora_A", "lora_B")].shape[0]
        for k, t in exported.items()
        if "lora_A" in k
    )
    assert rows[0]["up_params"] == 4 * dense and rows[0]["down_params"] == 0  # the dense steps, once
    assert len([k for k in exported if "lora_A" in k]) == modules
    # round 1 is one step per client (the session's plan), round 2 trains as configured
    assert all(first == last for first, last in rows[0]["client_loss"].values())
    assert any(first != last for first, last in rows[1]["client_loss"].values())
    # the exported adapter is A (orthonormal rows) and B R: R was trained off its initial diagonal
    for k, A in exported.items():
        if "lora_A" not in k:
            continue
        B = exported[k.replace("lora_A", "lora_B")]
        assert torch.allclose(A @ A.T, torch.eye(A.shape[0]), atol=1e-4)
        gram = B.T @ B  # = R^T R, B having orthonormal columns
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.norm() > 1e-3 * gram.norm(), k
    # the clients' personalization trains R (the hook's training view), not the bases without R
    for row in rows:
        personal = [v["personal_loss"] for v in row["personal"].values()]
        glob = [v["global_loss"] for v in row["personal"].values()]
        assert sum(personal) <= 1.5 * sum(glob), (personal, glob)


def test_a_fedsb_run_under_central_dp_takes_every_clients_block(tmp_path, builtin_base):
    """Mixed ranks under central DP: each site clips its r_k x r_k block's change from the leading block of
    the R it downloaded; no client is left out."""
    from conftest import tiny_overrides

    from fedllm.cli import main

    over = ["aggregation.name=fedsb", "lora.trainable_modules=[]", "privacy.mode=central"]
    assert main(["run", *tiny_overrides(tmp_path / "r", *over)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["n_updates"] for r in rows] == [4, 4] and all(not r["failed"] for r in rows)
    assert all(r["epsilon"] > 0 for r in rows)


def test_a_sites_clip_and_its_wire_measure_a_block_from_its_download(gen):
    """A rank-4 client's 4 x 4 block of R: its change is measured from the leading block of the 8 x 8 R it
    downloaded (its DP clip; a quantized upload's reference), not from zero."""
    from fedllm.privacy.transform import ClipAndNoise
    from fedllm.protocol import ClientStart, UploadContext
    from fedllm.transport.wire import reference

    R = torch.randn(RMAX, RMAX, generator=gen) * 3
    start = ClientStart(round=2, extras={f"{CORE}{KEY}": R})
    block = R[:4, :4] + 0.01
    up = ClientUpdate(0, 10, {}, extras={f"{CORE}{KEY}": block.clone()})
    out = ClipAndNoise(clip_norm=1.0).apply(up, UploadContext(start, {}, {}, (STEP, CORE)))
    assert_close(out.extras[f"{CORE}{KEY}"], block)  # a change of norm 0.04: no clip
    assert torch.equal(reference(up, start, {}, f"extras.{CORE}{KEY}"), R[:4, :4])


@pytest.mark.slow  # three tiny runs
def test_a_fedsb_run_resumes_exactly(tmp_path, builtin_base):
    from conftest import assert_resume_matches_straight

    assert_resume_matches_straight(tmp_path, "aggregation.name=fedsb", "lora.trainable_modules=[]")


def test_fedsb_is_registered_with_its_options():
    assert STRATEGIES["fedsb"] is FedSB
    cfg = load_config(None, ["aggregation.name=fedsb", "aggregation.fedsb.init_lr=0.01"])
    assert cfg.aggregation.fedsb.init_lr == 0.01
