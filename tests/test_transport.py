"""Quantized uploads (comm.*, fedllm/transport/) and FLoRIST under a download budget."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedllm.transport import QuantizedUpload
from fedllm.transport.codec import Encoded, EncodingError, decode, encode, wire_bytes
from tests.conftest import tiny_overrides


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000])
def test_integer_round_trip_is_within_half_a_step_of_each_block(fmt, numel, gen):
    x = torch.randn(numel, generator=gen) * torch.logspace(-3, 1, numel)  # blocks of very different scales
    e = encode(x.reshape(1, -1), fmt, block=64)
    y = decode(e).reshape(-1)
    levels = {"int8": 127, "int4": 7}[fmt]
    for b in range(math.ceil(numel / 64)):
        sl = slice(64 * b, 64 * (b + 1))
        step = float(x[sl].abs().max()) / levels
        assert float((y[sl] - x[sl]).abs().max()) <= step / 2 + 1e-7
    assert e.nbytes == wire_bytes(numel, fmt, 64)
    assert e.nbytes <= (1 if fmt == "int8" else 0.5) * numel + 1 + 4 * math.ceil(numel / 64)


@pytest.mark.parametrize("fmt,tol", [("float16", 1e-3), ("bfloat16", 8e-3), ("float32", 0.0)])
def test_float_round_trip(fmt, tol, gen):
    x = torch.randn(5, 7, generator=gen)
    e = encode(x, fmt)
    assert torch.allclose(decode(e), x, rtol=tol, atol=0) and e.nbytes == wire_bytes(35, fmt)


def test_int8_with_scales_is_at_most_027_of_float32():
    assert wire_bytes(64 * 1000, "int8", 64) / (4 * 64 * 1000) <= 0.27


def test_a_corrupted_encoding_is_refused_with_a_reason(gen):
    good = encode(torch.randn(100, generator=gen), "int4")
    bad = [
        Encoded("int4", good.shape, good.payload[:-1], good.scales),  # a byte short
        Encoded("int4", good.shape, good.payload, good.scales[:-1]),  # a scale short
        Encoded("int4", good.shape, good.payload, good.scales * float("nan")),  # scales not finite
        Encoded("int4", good.shape, torch.zeros_like(good.payload), good.scales),  # nibbles of -8
        Encoded("int8", good.shape, good.payload, good.scales),  # another format's payload
    ]
    for e in bad:
        with pytest.raises(EncodingError):
            decode(e)


def test_error_feedback_makes_the_decoded_sum_the_true_sum_up_to_the_last_residual(gen):
    """sum_t decoded_t = sum_t change_t - r_T exactly (Karimireddy et al.'s identity)."""
    t = QuantizedUpload("int4", error_feedback=True, block=16)
    state: dict = {}
    true, got = torch.zeros(40), torch.zeros(40)
    for _ in range(30):
        change = torch.randn(40, generator=gen) * 0.1
        true += change
        got += t._travel("A.m", change, state)[0]
    assert torch.allclose(got, true - state["comm.ef.A.m"], atol=1e-5)
    assert float(state["comm.ef.A.m"].abs().max()) < 0.1  # the residual stays bounded
    plain = QuantizedUpload("int4", error_feedback=False, block=16)
    assert plain._travel("A.m", torch.ones(3), {}) is not None


@pytest.mark.parametrize("fmt,big", [("float16", 7e4), ("bfloat16", float("inf")), ("int8", float("nan"))])
def test_a_value_its_format_cannot_carry_is_refused_at_the_site_and_the_residual_stays_clean(fmt, big, gen):
    """A change of 7e4 would travel as float16's inf (and a non-finite one as anything's): the upload is
    refused with a line naming the format, the tensor and the value, the error-feedback residuals are
    those from before it (none half-written), and the next, ordinary upload arrives finite."""
    from fedllm.factors import LoraFactors
    from fedllm.protocol import ClientStart, ClientUpdate, UploadContext

    t = QuantizedUpload(fmt, error_feedback=True, block=16)
    zero = {m: LoraFactors(torch.zeros(2, 8), torch.zeros(8, 2), 1.0) for m in ("m1", "m2")}

    def upload(scale_b: float):
        factors = {
            m: LoraFactors(
                torch.randn(2, 8, generator=gen) * 0.1, torch.randn(8, 2, generator=gen) * 0.1, 1.0
            )
            for m in zero
        }
        factors["m2"].B[0, 0] = scale_b
        update = ClientUpdate(client_id=0, num_examples=4, factors=factors)
        return t.apply(update, UploadContext(ClientStart(round=1), zero, state))

    state: dict = {}
    upload(0.05)
    before = {k: v.clone() for k, v in state.items()}
    assert len(before) == 4
    with pytest.raises(EncodingError, match=f"comm.upload = {fmt}: the change of B.m2: .*"):
        upload(big)
    assert state.keys() == before.keys()
    for k, v in before.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
    after = upload(0.05)
    assert all(torch.isfinite(f.A).all() and torch.isfinite(f.B).all() for f in after.factors.values())
    assert all(torch.isfinite(v).all() for v in state.values())


def test_float16_overflow_names_the_largest_value(gen):
    with pytest.raises(EncodingError, match="magnitude 7e\\+04 is beyond float16's largest, 65504"):
        encode(torch.tensor([1.0, -7e4]), "float16")
    assert torch.isfinite(decode(encode(torch.tensor([65504.0]), "float16"))).all()


def _run(tmp_path, name, *extra):
    from fedllm.config import load_config
    from fedllm.simulation import Simulation

    cfg = load_config(None, tiny_overrides(tmp_path / name, *extra))
    sim = Simulation(cfg, tmp_path / name)
    sim.setup()
    sim.run()
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_an_int8_run_uploads_at_most_027_of_float32_bytes_and_still_learns(tmp_path, builtin_base):
    base = _run(tmp_path, "f32")
    q = _run(tmp_path, "int8", "comm.upload=int8")
    assert sum(r.get("up_params", 0) for r in q) == sum(
        r.get("up_params", 0) for r in base
    )  # the same values travel
    assert 0 < sum(r.get("up_bytes", 0) for r in q) <= 0.27 * sum(r.get("up_bytes", 0) for r in base)
    assert math.isfinite(q[-1]["eval_loss"]) and q[-1]["eval_loss"] < q[0]["eval_loss"] * 1.5
    state = list((tmp_path / "int8" / "clients").rglob("*.safetensors"))
    assert state  # each client keeps its residual


@pytest.mark.slow
def test_florist_never_downloads_more_than_its_budget(tmp_path, builtin_base):
    free = _run(
        tmp_path, "free", "aggregation.name=florist", "federation.rounds=3", "lora.trainable_modules=[]"
    )
    top = max(r.get("down_bytes_max", 0) for r in free)
    assert top > 0
    budget_mb = top / 2 / 1e6
    rows = _run(
        tmp_path,
        "budget",
        "aggregation.name=florist",
        "federation.rounds=3",
        "lora.trainable_modules=[]",
        f"aggregation.florist.download_budget_mb={budget_mb}",
    )
    assert all(r.get("down_bytes_max", 0) <= budget_mb * 1e6 for r in rows)
    assert any(r.get("down_bytes_max", 0) > 0 for r in rows[2:])  # still something to merge


def test_budget_ranks_take_the_largest_share_that_fits():
    from fedllm.aggregation.florist import FLoRIST

    s = {"a": (torch.tensor([3.0, 2.0, 1.0]), 10), "b": (torch.tensor([1.0, 1.0]), 20)}
    algo = FLoRIST(tau=1.0, download_budget_mb=4 * (2 * 10 + 1 * 20) / 1e6)
    ranks, share = algo.budget_ranks(s)
    assert sum(4 * p * s[k][1] for k, p in ranks.items()) <= algo.budget_mb * 1e6
    assert ranks == {"a": 1, "b": 1} and share == 0.5  # one share for all: b needs 0.5, a then 1
    assert FLoRIST(tau=1.0, download_budget_mb=1e-9).budget_ranks(s)[0] == {"a": 0, "b": 0}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fedit", "flexlora"])
def test_fedit_and_flexlora_never_download_more_than_the_budget(strategy, tmp_path, builtin_base):
    """Half of what each downloads freely: every round's largest download stays under it, and something
    is still downloaded (a lower rank, padded and revived on the client, trains as usual)."""
    common = (f"aggregation.name={strategy}", "federation.rounds=3", "lora.trainable_modules=[]")
    free = _run(tmp_path, "free", *common)
    top = max(r.get("down_bytes_max", 0) for r in free)
    assert top > 0
    budget_mb = top / 2 / 1e6
    rows = _run(tmp_path, "budget", *common, f"aggregation.{strategy}.download_budget_mb={budget_mb}")
    assert all(r.get("down_bytes_max", 0) <= budget_mb * 1e6 for r in rows)
    assert all(r["down_bytes_max"] > 0 for r in rows[2:])
    assert math.isfinite(rows[-1]["eval_loss"])


def test_flexlora_budget_takes_the_largest_energy_share_of_the_global_svd():
    from fedllm.aggregation.base import GlobalState
    from fedllm.aggregation.flexlora import FlexLoRA
    from fedllm.factors import LoraFactors, singular_values

    gen = torch.Generator().manual_seed(0)
    q_b, _ = torch.linalg.qr(torch.randn(12, 4, generator=gen))
    q_a, _ = torch.linalg.qr(torch.randn(10, 4, generator=gen))
    s = torch.tensor([4.0, 2.0, 1.0, 0.5])
    state = GlobalState({"m": LoraFactors(q_a.T.contiguous(), q_b * s, 1.0)}, {})
    assert torch.allclose(singular_values(state.factors["m"]), s)
    algo = FlexLoRA(download_budget_mb=4 * 2 * (12 + 10) / 1e6)  # two components of this module
    got = algo.client_factors(state, rank=3, scale=0.5, client_id=0)["m"]
    assert got.rank == 2  # the two largest, not the client's three
    want = state.factors["m"].B[:, :2] @ state.factors["m"].A[:2]
    assert torch.allclose(got.scale * got.B @ got.A, want, atol=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["aggregation.name=flora", "aggregation.flora.download_budget_mb=1"], "unknown config key"),
        (["aggregation.name=fedit", "aggregation.fedit.download_budget_mb=1"], "lora.trainable_modules = "),
        (
            ["aggregation.name=florist", "aggregation.florist.download_budget_mb=1",
             "aggregation.florist.fixed_rank=2", "lora.trainable_modules=[]"],
            "both choose the rank",
        ),
    ],
)  # fmt: skip
def test_a_budget_the_strategy_cannot_keep_is_refused_in_one_line(overrides, message):
    from fedllm.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.slow
def test_an_encoded_download_is_what_the_client_and_the_servers_reference_start_from(tmp_path, builtin_base):
    """comm.download=int8: the ledger counts the encoded download bytes (payload plus scales), the
    client's start is the decoded download, which is also the server's reference for its update."""
    rows = _run(tmp_path, "q", "comm.download=int8", "federation.rounds=2", "lora.trainable_modules=[]")
    free = _run(tmp_path, "f", "federation.rounds=2", "lora.trainable_modules=[]")
    down_q, down_f = (sum(r.get("down_bytes", 0) for r in x) for x in (rows, free))
    assert sum(r.get("down_params", 0) for r in rows) == sum(r.get("down_params", 0) for r in free) > 0
    assert 0 < down_q <= 0.27 * down_f
    assert math.isfinite(rows[-1]["eval_loss"])


def test_quantized_download_round_trip_and_bytes(gen):
    from fedllm.factors import LoraFactors
    from fedllm.protocol import ClientStart
    from fedllm.transport import QuantizedDownload

    start = ClientStart(
        2,
        factors={"m": LoraFactors(torch.randn(4, 64, generator=gen), torch.randn(32, 4, generator=gen), 0.5)},
        dense={"d": torch.randn(128, generator=gen)},
        algo={"c": torch.randn(64, generator=gen)},
    )
    q = QuantizedDownload("int8", 64)
    got = q(start)
    for a, b in ((got.factors["m"].A, start.factors["m"].A), (got.dense["d"], start.dense["d"])):
        step = b.abs().max() / 127
        assert float((a - b).abs().max()) <= float(step) / 2 + 1e-6
    assert got.factors["m"].scale == 0.5 and set(got.attachments["wire"]) == {
        "factors.m.A",
        "factors.m.B",
        "dense.d",
        "algo.c",
    }
    assert q.nbytes(start) == sum(n + 4 * math.ceil(n / 64) for n in (256, 128, 128, 64))


def test_an_encoded_download_is_refused_where_clients_merge_it_into_their_base():
    from fedllm.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="merge every round's update into their base"):
        load_config(None, ["aggregation.name=florist", "comm.download=int8"])


def test_a_run_written_in_either_earlier_layout_of_the_budget_still_loads(tmp_path):
    """The budget was aggregation.florist.download_budget_mb, then aggregation.download_budget_mb for three
    strategies, and is now each strategy's own again: a run folder's config.yaml of either layout is read
    under the key of today (export, resume, eval keep working)."""
    from fedllm.config import load_config

    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    tail = "lora:\n  trainable_modules: []\n"
    first.write_text("aggregation:\n  name: florist\n  florist:\n    download_budget_mb: 0.25\n" + tail)
    second.write_text("aggregation:\n  name: florist\n  download_budget_mb: 0.25\n" + tail)
    assert load_config(first).aggregation.florist.download_budget_mb == 0.25
    with pytest.warns(FutureWarning, match="is now 'aggregation.florist.download_budget_mb'"):
        assert load_config(second).aggregation.florist.download_budget_mb == 0.25


def test_under_partial_participation_the_budget_bounds_each_rounds_state_and_catchup_is_counted_apart(
    tmp_path, builtin_base
):
    """FLoRIST under a budget with 2 of 6 clients a round: a client that missed rounds downloads their merges
    too (its catch-up, exact, so its base is the server's). What the budget bounds, one round's state, stays
    within it in every round (down_bytes_max_round); the earlier merges are counted apart
    (down_catchup_bytes, their total in the summary), and the whole download is their sum."""
    budget_mb = 0.03
    rows = _run(
        tmp_path,
        "partial",
        "aggregation.name=florist",
        "federation.num_clients=6",
        "federation.client_fraction=0.34",
        "federation.rounds=6",
        "lora.trainable_modules=[]",
        f"aggregation.florist.download_budget_mb={budget_mb}",
    )[1:]
    assert all(r["down_bytes_max_round"] <= budget_mb * 1e6 for r in rows), [
        r["down_bytes_max_round"] for r in rows
    ]
    assert any(r["down_bytes_max_round"] > 0 for r in rows[1:])  # something is merged under the budget
    catchup = [r["down_catchup_bytes"] for r in rows]
    assert sum(catchup) > 0  # clients that missed merges caught up, beyond what the budget bounds
    assert all(r["down_bytes_max"] >= r["down_bytes_max_round"] for r in rows)
    assert all(r["down_bytes"] >= r["down_catchup_bytes"] for r in rows)
    summary = json.loads((tmp_path / "partial" / "summary.json").read_text())
    assert summary["communication"]["total_down_catchup_bytes"] == sum(catchup)
