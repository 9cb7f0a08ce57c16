"""Client-batched local training (federation.client_batch, fedllm/client/batched.py): each client's update
is the one it gets alone."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from fedllm.config import ConfigError, load_config
from tests.conftest import TEST_PRETRAIN_STEPS, assert_close_updates, tiny_overrides

STRATEGIES = ("fedit", "flora", "flexlora", "florist", "fedex", "hetlora", "ffa", "fedsa")
ALGORITHMS = ("sft", "fedprox", "scaffold")
# the default run's share of the matrix (the whole of it: pytest -m slow)
QUICK = {("fedit", "scaffold"), ("hetlora", "fedprox")}


def _overrides(strategy: str, algorithm: str, k: int) -> list[str]:
    return [
        f"model.builtin_pretrain_steps={TEST_PRETRAIN_STEPS}",
        "data.builtin_examples_per_skill=12",
        "data.min_examples_per_client=4",
        "data.partition=dirichlet",  # unequal data sizes
        "data.dirichlet_alpha=0.3",
        "federation.num_clients=3",
        "lora.ranks=[2,4,8]",
        "lora.dropout=0.2",  # each client's own masks
        "lora.trainable_modules=[]",
        "client.local_steps_per_client=[3,5,2]",  # unequal local steps
        "client.batch_size=4",
        f"client.algorithm={algorithm}",
        f"aggregation.name={strategy}",
        *(
            ["aggregation.hetlora.prune_gamma=0.5", "aggregation.hetlora.prune_lambda=0.01"]
            if strategy == "hetlora"
            else []
        ),
        f"federation.client_batch={k}",
        "eval.benchmark=none",
    ]


def _updates(
    builtin_base,
    strategy: str,
    algorithm: str,
    k: int,
    extra: tuple = (),
    cpu: bool = True,
) -> dict:
    """Round 1's and round 2's updates of every client (float64 model: the comparison sees the algorithm, not
    float32 summation order), the second round from the server's aggregate of the first.

    ``k = 1`` is the reference: each client trained alone through ``runtime.train``, never through the
    batched path (``train_many`` batches whatever it is handed, so a reference through it would compare a
    batched run with a batched run). ``k > 1`` hands all clients to ``train_many`` at once."""
    from accelerate import Accelerator

    from fedllm import assembly

    cfg = load_config(None, [*_overrides(strategy, algorithm, k), *extra])
    fed = assembly.assemble(cfg, Accelerator(cpu=cpu))
    fed.runtime.model.double()
    out = {}
    for round_idx in (1, 2):
        plan = fed.server.plan_round(round_idx)
        clients = [fed.clients[c] for c in plan.active]
        starts = [plan.starts[c.client_id] for c in clients]
        if k == 1:
            got = [fed.runtime.train(c, s) for c, s in zip(clients, starts, strict=True)]
        else:
            with _no_fallback():  # clients trained alone after a failed batch would pass for equal
                got = fed.runtime.train_many(clients, starts)
        for u in got:
            assert not isinstance(u, Exception), u
            out.update({(round_idx, u.client_id, m, "A"): f.A for m, f in u.factors.items()})
            out.update({(round_idx, u.client_id, m, "B"): f.B for m, f in u.factors.items()})
            out.update({(round_idx, u.client_id, e): v for e, v in u.extras.items()})
        report = fed.server.finish_round(plan, {u.client_id: u for u in got})
        if report.merged:
            fed.runtime.merge(round_idx, report.merged)
    return out


@contextlib.contextmanager
def _no_fallback():
    """Fails if client-batched training fell back to training each client alone."""
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logger = logging.getLogger("fedllm.client.runtime")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "client-batched training failed" in m], seen


def _valid(strategy: str, algorithm: str) -> bool:
    """The combinations the config accepts (SCAFFOLD needs a strategy that averages parameters)."""
    try:
        load_config(None, _overrides(strategy, algorithm, 1))
    except ConfigError:
        return False
    return True


MATRIX = [
    pytest.param(s, a, marks=() if (s, a) in QUICK else pytest.mark.slow)
    for s in STRATEGIES
    for a in ALGORITHMS
    if _valid(s, a)
]
assert {tuple(p.values) for p in MATRIX} >= QUICK


def _worst(alone: dict, together: dict) -> tuple[float, object]:
    """The largest relative difference between two runs' updates, and where."""
    assert alone.keys() == together.keys()
    worst, where = 0.0, None
    for key, want in alone.items():
        rel = float((together[key] - want).norm()) / max(float(want.norm()), 1e-12)
        if rel > worst:
            worst, where = rel, key
    return worst, where


@pytest.mark.parametrize("strategy,algorithm", MATRIX)
def test_batched_clients_get_their_lone_updates(builtin_base, strategy, algorithm):
    alone = _updates(builtin_base, strategy, algorithm, 1)
    together = _updates(builtin_base, strategy, algorithm, 3)
    worst, where = _worst(alone, together)
    assert worst <= 1e-5, (where, worst)


def _mean_over_the_whole_batch(logits, batches):
    """A batching fault: each client's summed token losses divided by the whole stacked batch's count."""
    width = logits.shape[1]
    labels = torch.cat(
        [torch.nn.functional.pad(b["labels"], (0, width - b["labels"].shape[1]), value=-100) for b in batches]
    )[:, 1:]
    tokens = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    ).view(labels.shape)
    total, out, row = (labels != -100).sum(), [], 0
    for b in batches:
        n = b["labels"].shape[0]
        out.append(tokens[row : row + n].sum() / total)
        row += n
    return out


def _rows_to_the_next_client():
    """A batching fault: every client's rows routed one adapter along (the last client's to the first's)."""
    from fedllm.client.batched import Routing, _Span

    class Shifted(Routing):
        @property
        def spans(self):
            return self._spans

        @spans.setter
        def spans(self, spans):
            slots = [s.slot for s in spans]
            Routing.spans.fset(
                self,
                [
                    _Span(slots[(i + 1) % len(spans)], s.row, s.rows, s.width, s.masks)
                    for i, s in enumerate(spans)
                ],
            )

    return Shifted


@pytest.mark.parametrize("fault", ["loss_normalization", "routing"])
def test_the_equivalence_test_fails_on_a_broken_batch(builtin_base, monkeypatch, fault):
    """The equivalence above is not blind: a batch whose per-client loss is normalized over the whole stacked
    batch, or whose rows go to another client's adapter, gives updates far from lone training's."""
    from fedllm.client import batched

    alone = _updates(builtin_base, "fedit", "sft", 1)
    if fault == "loss_normalization":
        monkeypatch.setattr(batched, "client_losses", _mean_over_the_whole_batch)
    else:
        monkeypatch.setattr(batched, "Routing", _rows_to_the_next_client())
    together = _updates(builtin_base, "fedit", "sft", 3)
    worst, where = _worst(alone, together)
    assert worst > 1e-2, (fault, where, worst)


@pytest.mark.parametrize(
    "strategy, flag",
    [
        ("fedit", "as-transformers-says"),
        ("fedit", "flag-gone"),
        pytest.param("hetlora", "as-transformers-says", marks=pytest.mark.slow),
    ],
)
def test_batched_with_gradient_checkpointing_and_dropout_gets_lone_updates(
    builtin_base, strategy, flag, monkeypatch
):
    """Gradient checkpointing recomputes each block's forward in the backward: each client's dropout masks
    must be drawn again as the forward drew them (its own generator, which torch's checkpoint does not
    restore), else dx sees one mask and dA, dB another (HetLoRA: a hooked layer's path). ``flag-gone``: the
    model's ``is_gradient_checkpointing`` / ``is_activation_checkpointing`` report False (the deprecated
    property removed, as transformers 6 does): the replay is decided from the modules and still happens."""
    from transformers import PreTrainedModel

    from fedllm.client import batched

    if flag == "flag-gone":
        for name in ("is_gradient_checkpointing", "is_activation_checkpointing"):
            monkeypatch.setattr(PreTrainedModel, name, property(lambda self: False), raising=False)
    noise, replayed = batched.Routing._noise, []

    def counted(self, m, x, dtype):
        replayed.append(self.replays and id(m) in self._drawn)
        return noise(self, m, x, dtype)

    extra = ("model.gradient_checkpointing=true",)
    alone = _updates(builtin_base, strategy, "sft", 1, extra=extra)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batched.Routing, "_noise", counted)
        together = _updates(builtin_base, strategy, "sft", 3, extra=extra)
    assert any(replayed) and not all(replayed)  # recomputed forwards drew their masks again
    worst, where = _worst(alone, together)
    assert worst <= 1e-5, (where, worst)


@pytest.mark.slow
def test_batched_run_matches_the_one_at_a_time_run(builtin_base, tmp_path):
    """Whole runs in float32 (the user's setting): the global adapters agree to float32 noise, which AdamW's
    normalization of near-cancelling gradient entries raises above 1e-5 (docs/scale.md)."""
    from fedllm.simulation import Simulation

    runs = {}
    for k in (1, 4):
        extra = ["lora.trainable_modules=[]", "lora.ranks=[2,4,8,4]", f"federation.client_batch={k}"]
        cfg = load_config(None, tiny_overrides(tmp_path / f"k{k}", *extra))
        sim = Simulation(cfg, tmp_path / f"k{k}")
        sim.setup()
        sim.run()
        runs[k] = tmp_path / f"k{k}"
    assert_close_updates(runs[1], runs[4], 1e-3)


def test_batching_needs_adapters_only_and_says_why_others_train_alone(builtin_base, caplog):
    with pytest.raises(ConfigError, match="federation.client_batch = 2 with lora.trainable_modules"):
        load_config(None, ["federation.client_batch=2", "lora.trainable_modules=[embed_tokens]"])
    from accelerate import Accelerator

    from fedllm import assembly

    cfg = load_config(None, _overrides("fedit", "perfedavg", 2))
    fed = assembly.assemble(cfg, Accelerator(cpu=True))
    plan = fed.server.plan_round(1)
    clients = [fed.clients[c] for c in plan.active][:2]
    with caplog.at_level("INFO", logger="fedllm.client.runtime"):
        got = fed.runtime.train_many(clients, [plan.starts[c.client_id] for c in clients])
    assert not any(isinstance(u, Exception) for u in got)
    assert "one at a time: client.algorithm=perfedavg takes several forwards" in caplog.text


def test_a_failing_batch_falls_back_to_each_client_alone(builtin_base, monkeypatch, caplog):
    from accelerate import Accelerator

    from fedllm import assembly
    from fedllm.client import runtime

    cfg = load_config(None, _overrides("fedit", "sft", 3))
    fed = assembly.assemble(cfg, Accelerator(cpu=True))
    plan = fed.server.plan_round(1)
    clients = [fed.clients[c] for c in plan.active]

    def broken(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(runtime, "train_together", broken)
    with caplog.at_level("WARNING"):
        got = fed.runtime.train_many(clients, [plan.starts[c.client_id] for c in clients])
    assert len(got) == 3 and not any(isinstance(u, Exception) for u in got)
    assert (
        "client-batched training failed (RuntimeError: out of memory); training each client alone"
        in caplog.text
    )
    assert torch.isfinite(torch.tensor([u.metrics["loss_last"] for u in got])).all()


def _routed_case(dtype=torch.float64, dropout=(True, False, True), frozen_a=False):
    """Three clients' rows of a stacked batch (4, 2 and 3 rows of width 5), ranks 2, 5 and 3, one base
    projection 6 -> 7, and the routed layer's description; the masks as a client's lone dropout draws them."""
    from fedllm.client.batched import _Layer

    g = torch.Generator().manual_seed(0)
    rows, width, ranks, scales = [4, 2, 3], 5, [2, 5, 3], [0.5, 2.0, 1.25]
    x = torch.randn(sum(rows), width, 6, generator=g, dtype=dtype)
    w = torch.randn(7, 6, generator=g, dtype=dtype)
    a = [torch.randn(r, 6, generator=g, dtype=dtype).requires_grad_(not frozen_a) for r in ranks]
    b = [torch.randn(7, r, generator=g, dtype=dtype).requires_grad_() for r in ranks]
    bounds, noise, at = [], [], 0
    for n, drops in zip(rows, dropout, strict=True):
        bounds.append((at * width, (at + n) * width))
        at += n
        mask = (torch.rand(n * width, 6, generator=g) > 0.3).to(dtype) / 0.7
        noise.append(mask if drops else None)
    return x, w, a, b, _Layer(scales, bounds, noise, dtype)


def _reference(x, w, a, b, layer):
    """Each client's rows through ``x W^T + s B A drop(x)`` with plain autograd."""
    flat = x.reshape(-1, x.shape[-1])
    parts = []
    for (lo, hi), ak, bk, s, noise in zip(layer.bounds, a, b, layer.scales, layer.noise, strict=True):
        xk = flat[lo:hi] if noise is None else flat[lo:hi] * noise
        parts.append(flat[lo:hi] @ w.T + s * (xk @ ak.T) @ bk.T)
    return torch.cat(parts).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("frozen_a", [False, True])
def test_the_routed_layer_is_autograd_through_each_clients_adapter(frozen_a):
    """Output and gradients (input, A, B) of the hand-written backward equal plain autograd's in float64, with
    unequal ranks, rows and scales, dropout on two of three clients and (FFA-LoRA) a frozen A."""
    from fedllm.client.batched import _RoutedLoRA

    x, w, a, b, layer = _routed_case(frozen_a=frozen_a)
    x.requires_grad_()
    upstream = torch.randn(
        x.shape[0], x.shape[1], 7, dtype=x.dtype, generator=torch.Generator().manual_seed(1)
    )
    got = _RoutedLoRA.apply(torch.nn.functional.linear(x, w), x, layer, *a, *b)
    grads = torch.autograd.grad((got * upstream).sum(), [x, *[t for t in a + b if t.requires_grad]])
    want = _reference(x, w, a, b, layer)
    wants = torch.autograd.grad((want * upstream).sum(), [x, *[t for t in a + b if t.requires_grad]])
    torch.testing.assert_close(got, want)
    for g, r in zip(grads, wants, strict=True):
        torch.testing.assert_close(g, r)
    assert all(t.grad is None for t in a + b)

    def fn(xx, *weights):
        return _RoutedLoRA.apply(torch.nn.functional.linear(xx, w), xx, layer, *weights)

    small = [t.detach().clone().requires_grad_(t.requires_grad) for t in a + b]
    assert torch.autograd.gradcheck(fn, (x.detach().clone().requires_grad_(), *small))


def test_the_routed_layer_under_bf16_autocast_is_the_modules_bf16_product():
    """Under autocast (a GPU's bf16, here the CPU's) the adapters' products run in the autocast dtype, as
    peft's modules run there, and their gradients arrive in the adapters' own dtype."""
    from fedllm.client.batched import _Layer, _RoutedLoRA

    x, w, a, b, layer = _routed_case(dtype=torch.float32, dropout=(False, False, False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = _Layer(layer.scales, layer.bounds, layer.noise, torch.bfloat16)
        got = _RoutedLoRA.apply(torch.nn.functional.linear(x, w), x, bf16, *a, *b)
        flat = x.reshape(-1, 6)
        want = torch.cat(
            [
                torch.nn.functional.linear(flat[lo:hi], w)
                + torch.nn.functional.linear(torch.nn.functional.linear(flat[lo:hi], ak), bk) * s
                for (lo, hi), ak, bk, s in zip(layer.bounds, a, b, layer.scales, strict=True)
            ]
        ).view(got.shape)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all() for t in a + b)


def _round_one(strategy: str, k: int, victim_at: int, monkeypatch) -> tuple[dict, dict, int]:
    """Round 1 with ``comm.upload=int8`` (an error-feedback residual in each client's state) where the client
    at ``victim_at`` of the round fails at read-out: each client's update (or error) and state after it."""
    from accelerate import Accelerator

    from fedllm import assembly, transport

    cfg = load_config(None, [*_overrides(strategy, "sft", k), "comm.upload=int8"])
    fed = assembly.assemble(cfg, Accelerator(cpu=True))
    fed.runtime.model.double()
    plan = fed.server.plan_round(1)
    clients = [fed.clients[c] for c in plan.active]
    starts = [plan.starts[c.client_id] for c in clients]
    victim = clients[victim_at].client_id
    apply = transport.QuantizedUpload.apply

    def failing(self, update, ctx):
        if update.client_id == victim:
            raise ValueError("comm.upload=int8: a non-finite change")
        return apply(self, update, ctx)

    monkeypatch.setattr(transport.QuantizedUpload, "apply", failing)
    if k == 1:
        got = [fed.runtime._train_or_error(c, s) for c, s in zip(clients, starts, strict=True)]
    else:
        got = fed.runtime.train_many(clients, starts)
    updates = {c.client_id: u for c, u in zip(clients, got, strict=True)}
    return updates, {c.client_id: dict(c.state) for c in clients}, victim


@pytest.mark.parametrize("strategy", ["fedsa", pytest.param("fedit", marks=pytest.mark.slow)])
def test_a_failing_client_leaves_the_others_of_its_batch_as_lone_training_does(
    builtin_base, monkeypatch, caplog, strategy
):
    """The last client of a batch fails at read-out, after the others have written their error-feedback
    residuals (and FedSA-LoRA its local B): they are trained again alone from the state they had before the
    batch, so each one's update and state equal its lone training's; the failing client alone is left out."""
    with caplog.at_level("WARNING"):
        together, state_together, victim = _round_one(strategy, 3, -1, monkeypatch)
    assert "client-batched training failed (ValueError" in caplog.text
    alone, state_alone, _ = _round_one(strategy, 1, -1, monkeypatch)
    assert isinstance(together[victim], ValueError) and isinstance(alone[victim], ValueError)
    others = [c for c in alone if c != victim]
    assert others and all(not isinstance(together[c], Exception) for c in others)
    for c in others:
        assert state_together[c].keys() == state_alone[c].keys() and state_alone[c]
        for key, want in state_alone[c].items():
            torch.testing.assert_close(state_together[c][key], want, rtol=1e-9, atol=1e-12, msg=key)
        for m, f in alone[c].factors.items():
            torch.testing.assert_close(together[c].factors[m].A, f.A, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(together[c].factors[m].B, f.B, rtol=1e-9, atol=1e-12)
