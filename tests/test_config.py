"""Config loading, overrides and the errors they raise."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedllm.config import ConfigError, help_text, load_config, valid_keys
from fedllm.config.overrides import parse_override


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg.model.name == "builtin"
    assert len(set(cfg.lora.ranks)) > 1  # ranks really differ per client by default


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("federation:\n  rounds: 7\nlora:\n  ranks: [2, 4]\naggregation:\n  name: florist\n")
    cfg = load_config(
        path, ["federation.rounds=3", "aggregation.florist.tau=0.8", "client.lr=1e-4", "lora.ranks=[8,8,4]"]
    )
    assert cfg.federation.rounds == 3
    assert cfg.aggregation.name == "florist" and cfg.aggregation.florist.tau == 0.8
    assert cfg.client.lr == pytest.approx(1e-4)
    assert cfg.lora.ranks == [8, 8, 4]


def test_int_is_accepted_for_float():
    assert load_config(None, ["aggregation.florist.tau=1"]).aggregation.florist.tau == 1.0


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("federaton.rounds=3", r"unknown config key 'federaton.rounds'.*did you mean 'federation.rounds'"),
        ("lora.rnaks=[4]", r"did you mean 'lora.ranks'"),
        (
            "aggregation.name=fedsgd",
            r"aggregation.name = 'fedsgd' is unknown; valid choices: .*fedit.*flexlora",
        ),
        ("aggregation.florist.tau=0", r"aggregation.florist.tau = 0.0 is invalid: expected in \(0, 1\]"),
        ("aggregation.florist.tau=1.5", r"aggregation.florist.tau"),
        ("aggregation.florist.fixed_rank=-1", r"aggregation.florist.fixed_rank"),
        ("lora.ranks=[4,0]", r"lora.ranks: rank 0 is invalid"),
        ("lora.ranks=[-2]", r"lora.ranks: rank -2"),
        ("federation.rounds=0", r"federation.rounds = 0 is invalid"),
        ("federation.rounds=abc", r"federation.rounds: expected int"),
        ("federation.client_fraction=0", r"federation.client_fraction"),
        ("client.lr=0", r"client.lr = 0.0 is invalid: expected > 0"),
        ("client.lr=-1e-3", r"client.lr"),
        ("federation.clients_per_round=9", r"clients_per_round = 9 exceeds federation.num_clients = 4"),
        ("client.algorithm=adam", r"client.algorithm = 'adam' is unknown"),
        (
            "data.partition=random",
            r"data.partition = 'random' is invalid: expected one of iid, dirichlet, shards",
        ),
        ("model.quantization=2bit", r"model.quantization"),
        ("lora.dropout=1.0", r"lora.dropout"),
        ("rounds=3", r"unknown config key 'rounds'"),
        ("federation.rounds", r"must look like section.key=value"),
    ],
)
def test_bad_config_errors(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_bad_yaml_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("federation: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    flat = tmp_path / "flat.yaml"
    flat.write_text("rounds: 3\n")
    with pytest.raises(ConfigError, match="'rounds' must be a section"):
        load_config(flat)


def test_every_option_has_help():
    text = help_text()
    for key in valid_keys():
        assert key in text
    assert all(": " in line and line.split(": ", 1)[1] for line in text.splitlines())


def test_parse_override_reads_yaml_values():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("a.b=x=y") == ("a.b", "x=y")


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
)
def test_every_shipped_experiment_config_loads(name):
    """Every experiment YAML in configs/ passes the config checks (paths are checked when a run starts)."""
    cfg = load_config(str(Path(__file__).resolve().parent.parent / "configs" / name), [])
    assert cfg.federation.num_clients >= 1


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("aggregation.tau=0.8", "aggregation.florist.tau"),
        ("aggregation.router_lr=0.1", "aggregation.floral.router_lr"),
        ("aggregation.hetlora_prune_gamma=0.5", "aggregation.hetlora.prune_gamma"),
        ("aggregation.flexlora_split=sqrt", "aggregation.flexlora.split"),
        ("client.mu=0.1", "client.fedprox.mu"),
        ("client.scaffold_optimizer=adamw", "client.scaffold.optimizer"),
        ("client.perfedavg_variant=hf", "client.perfedavg.variant"),
    ],
)
def test_an_old_flat_key_is_refused_with_the_key_that_replaced_it(old, new):
    with pytest.raises(ConfigError, match=f"is now '{new}'"):
        load_config(None, [old])


def test_a_methods_options_live_under_its_name_in_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("aggregation:\n  name: floral\n  floral:\n    num_adaptors: 3\nlora:\n  ranks: [4]\n")
    cfg = load_config(path, ["aggregation.floral.router_lr=0.5", "client.perfedavg.alpha=0.01"])
    assert cfg.aggregation.floral.num_adaptors == 3 and cfg.aggregation.floral.router_lr == 0.5
    assert cfg.client.perfedavg.alpha == 0.01
    with pytest.raises(ConfigError, match=r"aggregation.floral.router_lr = 0.0 is invalid: expected > 0"):
        load_config(path, ["aggregation.floral.router_lr=0"])
    with pytest.raises(ConfigError, match="unknown config key 'aggregation.floral.nope'"):
        load_config(path, ["aggregation.floral.nope=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("aggregation:\n  floral: 3\n")
    with pytest.raises(ConfigError, match="'aggregation.floral' must be a section"):
        load_config(bad)
    from fedllm.config import config_from_text, config_to_text

    assert config_from_text(config_to_text(cfg)) == cfg  # the resolved config reads back as it was


def test_each_strategy_and_algorithm_declares_its_options_in_its_own_file():
    import inspect

    from fedllm.aggregation import STRATEGIES
    from fedllm.client import ALGORITHMS

    for cls in [*STRATEGIES.values(), *ALGORITHMS.values()]:
        if cls.options is not None:
            assert inspect.getmodule(cls.options) is inspect.getmodule(cls), cls.name
    assert "aggregation.floral.num_adaptors" in valid_keys()
    assert not any(k.startswith(("aggregation.router", "client.perfedavg_")) for k in valid_keys())
