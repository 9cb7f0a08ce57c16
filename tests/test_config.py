"""Config loading, overrides and the errors they raise."""

from __future__ import annotations

import re
import warnings
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


@pytest.mark.parametrize(
    ("owner", "old", "value", "new"),
    [
        ("aggregation.name=fedit", "aggregation.robust", "median", "aggregation.fedit.robust"),
        ("aggregation.name=fedit", "aggregation.trim_fraction", 0.2, "aggregation.fedit.trim_fraction"),
        ("aggregation.name=flexlora", "aggregation.download_budget_mb", 0.5,
         "aggregation.flexlora.download_budget_mb"),
        ("aggregation.name=flora", "federation.catchup_window", 3, "aggregation.flora.catchup_window"),
        ("aggregation.name=fedex", "federation.catchup_window", 3, "aggregation.fedex.catchup_window"),
        ("client.algorithm=fedprox", "client.optimizer", "sgd", "client.fedprox.optimizer"),
        ("client.algorithm=sft", "client.optimizer", "sgd", "client.sft.optimizer"),
    ],
)  # fmt: skip
def test_a_key_that_moved_into_its_methods_options_loads_there_with_a_warning(owner, old, value, new):
    """The options that were general keys (aggregation.robust, ...) belong to the methods that use them; a
    config written before the move (a run folder's config.yaml) still loads, as the chosen method's option,
    wherever the old key stands (before or after the key that chooses the method)."""
    from fedllm.config import flat_config

    base = ["lora.trainable_modules=[]"]
    for overrides in ([owner, f"{old}={value}"], [f"{old}={value}", owner]):
        with pytest.warns(FutureWarning, match=f"'{old}' is now '{new}'"):
            cfg = load_config(None, base + overrides)
        assert flat_config(cfg)[new] == value
    assert flat_config(load_config(None, [*base, owner, f"{new}={value}"]))[new] == value


def _old_layout(name: str, algorithm: str, preset: str = "llm", **old: object) -> dict:
    """A resolved config.yaml as the version before the move wrote it: the moved keys in their general
    sections (at their defaults unless ``old`` says), no section for the methods that had no options."""
    import yaml

    from fedllm.config import config_to_text

    today = [f"aggregation.name={name}", f"client.algorithm={algorithm}", f"client.preset={preset}"]
    data = yaml.safe_load(config_to_text(load_config(None, [*today, "lora.trainable_modules=[]"])))
    for section, method in (("aggregation", "fedit"), ("aggregation", "fedex"), ("aggregation", "flora"),
                            ("client", "sft")):  # fmt: skip
        del data[section][method]
    for section, method, field in (("aggregation", "florist", "download_budget_mb"),
                                   ("aggregation", "florist", "catchup_window"),
                                   ("aggregation", "flexlora", "download_budget_mb"),
                                   ("client", "fedprox", "optimizer")):  # fmt: skip
        del data[section][method][field]
    data["aggregation"].update(name=name, robust="none", trim_fraction=0.1, download_budget_mb=0.0)
    data["federation"]["catchup_window"] = 8
    # the old paper preset wrote plain SGD into every algorithm's resolved config (perfedavg's too)
    optimizer = "sgd" if preset == "paper" else "adamw"
    data["client"]["optimizer"] = optimizer
    for key, value in old.items():
        section, field = key.split("__")
        data[section][field] = value
    return data


@pytest.mark.parametrize(
    ("name", "algorithm", "preset"),
    [("fedit", "scaffold", "llm"), ("flora", "fedprox", "paper"), ("florist", "sft", "llm"),
     ("fedit", "perfedavg", "paper"), ("fedex", "scaffold", "paper")],
)  # fmt: skip
def test_a_run_folder_written_before_the_move_loads_as_it_ran(tmp_path, name, algorithm, preset):
    """A config.yaml of the old layout (no fedit/flora/fedex/sft sections, the moved keys in the general ones)
    loads as the run it was written by, and a run folder's loads without a warning (its keys are not the
    user's to fix): the same config as today's keys give."""
    import yaml

    from fedllm.config import flat_config
    from fedllm.run.reader import RunFolder

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_old_layout(name, algorithm, preset)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = RunFolder(tmp_path).config()
    today = load_config(
        None, [f"aggregation.name={name}", f"client.algorithm={algorithm}", f"client.preset={preset}",
               "lora.trainable_modules=[]"],
    )  # fmt: skip
    assert flat_config(cfg) == flat_config(today)


def test_an_old_layouts_own_values_reach_the_method_that_used_them(tmp_path):
    import yaml

    path = tmp_path / "config.yaml"
    old = _old_layout(
        "florist", "fedprox", aggregation__download_budget_mb=0.25, federation__catchup_window=3,
        client__optimizer="sgd",
    )  # fmt: skip
    path.write_text(yaml.safe_dump(old))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(path, written=True)
    assert (cfg.aggregation.florist.download_budget_mb, cfg.aggregation.florist.catchup_window) == (0.25, 3)
    assert cfg.client.fedprox.optimizer == "sgd"
    with pytest.warns(FutureWarning, match="'aggregation.download_budget_mb' is now"):
        load_config(path)  # a file the user gives: said


def test_an_old_key_in_a_file_follows_the_method_an_override_chooses(tmp_path):
    """The chosen method is the one every layer together chooses (fedllm compare's --variant), and a later
    layer's new key wins over a file's old one; in one file, an old key left at its default gives way."""
    path = tmp_path / "base.yaml"
    path.write_text("aggregation:\n  download_budget_mb: 0.5\nclient:\n  optimizer: sgd\n"
                    "lora:\n  trainable_modules: []\n")  # fmt: skip
    with pytest.warns(FutureWarning):
        cfg = load_config(path, ["aggregation.name=flexlora", "client.algorithm=fedprox"])
    assert cfg.aggregation.flexlora.download_budget_mb == 0.5 and cfg.client.fedprox.optimizer == "sgd"
    with pytest.warns(FutureWarning):
        cfg = load_config(path, ["aggregation.fedit.download_budget_mb=0.1"])
    assert cfg.aggregation.fedit.download_budget_mb == 0.1  # the override's new key wins
    both = tmp_path / "both.yaml"
    both.write_text("aggregation:\n  robust: none\n  fedit:\n    robust: median\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(both).aggregation.fedit.robust == "median"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["aggregation.name=flora", "aggregation.robust=median"],
         "'aggregation.robust' = 'median' is now aggregation.fedit.robust; aggregation.name = flora has no"),
        (["aggregation.name=fedsa", "aggregation.download_budget_mb=1"],
         "is now aggregation.fedit.download_budget_mb, aggregation.flexlora.download_budget_mb, "
         "aggregation.florist.download_budget_mb; aggregation.name = fedsa has no such option"),
        (["client.optimizer=sgd", "client.sft.optimizer=adamw"],
         "'client.optimizer' = 'sgd' and 'client.sft.optimizer' = 'adamw': set only 'client.sft.optimizer'"),
        (["aggregation.robust=sometimes"], "aggregation.fedit.robust = 'sometimes' is invalid"),
    ],
)  # fmt: skip
def test_a_moved_key_a_method_cannot_take_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        load_config(None, overrides)


def test_a_moved_key_that_did_nothing_for_the_chosen_method_is_ignored_with_a_warning():
    """client.optimizer never applied to SCAFFOLD (client.scaffold.optimizer) or Per-FedAvg (always SGD), and
    the catch-up window only to merging strategies: such a value is ignored, as before, and said."""
    with pytest.warns(FutureWarning, match="did nothing for client.algorithm = scaffold and is ignored"):
        cfg = load_config(
            None, ["client.algorithm=scaffold", "client.scaffold.optimizer=adamw", "client.optimizer=sgd"]
        )
    assert cfg.client.scaffold.optimizer == "adamw"
    with pytest.warns(FutureWarning, match="did nothing for aggregation.name = fedit"):
        load_config(None, ["federation.catchup_window=2"])


def test_an_old_key_counts_as_set_by_the_config_under_a_preset():
    """client.preset=paper fills what the config does not set: an old key the config does set is its own."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default: no warning
        cfg = load_config(None, ["client.preset=paper", "client.optimizer=adamw"])
    assert cfg.client.sft.optimizer == "adamw" and cfg.client.scheduler == "constant"
    assert load_config(None, ["client.preset=paper"]).client.sft.optimizer == "sgd"
    assert (
        load_config(None, ["client.preset=paper", "client.algorithm=fedprox"]).client.fedprox.optimizer
        == "sgd"
    )


def test_every_methods_options_are_a_typed_field_of_its_section():
    """The sections are written out (a type checker reads cfg.aggregation.floral.router_lr); a method whose
    options have no field fails at import with what to add, and a field of no method is refused."""
    import dataclasses

    from fedllm.aggregation import SERVER_OPTIMIZERS, STRATEGIES
    from fedllm.aggregation.florist import FloristOptions
    from fedllm.config import AggregationConfig, _check_owned

    registry = {**STRATEGIES, **SERVER_OPTIMIZERS}
    _check_owned(AggregationConfig, registry, "aggregation")  # as at import

    class Newcomer:
        options = FloristOptions

    with pytest.raises(TypeError, match="newcomer's options FloristOptions have no field 'newcomer: Flori"):
        _check_owned(AggregationConfig, {**registry, "newcomer": Newcomer}, "aggregation")
    fewer = {k: v for k, v in registry.items() if k != "hetlora"}
    with pytest.raises(TypeError, match=r"fields for no registered method: \['hetlora'\]"):
        _check_owned(AggregationConfig, fewer, "aggregation")
    assert {f.name for f in dataclasses.fields(AggregationConfig) if "method" in f.metadata} >= {
        "fedit",
        "flora",
    }


def test_a_strategy_gets_its_options_at_construction():
    """strategy_from_config builds the strategy from its own options: nothing is assigned to it afterwards."""
    import ast

    from fedllm.aggregation import strategy_from_config

    cfg = load_config(None, ["aggregation.fedit.robust=trimmed_mean", "aggregation.fedit.trim_fraction=0.25"])
    s = strategy_from_config(cfg.aggregation)
    assert (s.robust, s.trim_fraction, s.budget_mb) == ("trimmed_mean", 0.25, 0.0)
    cfg = load_config(None, ["aggregation.name=florist", "aggregation.florist.catchup_window=3"])
    assert strategy_from_config(cfg.aggregation).catchup_window == 3
    root = Path(__file__).resolve().parent.parent / "fedllm"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in [e for x in targets for e in (x.elts if isinstance(x, ast.Tuple) else [x])]:
                assert not (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "strategy"
                ), f"{path}:{node.lineno} assigns to a built strategy"


@pytest.mark.slow
def test_a_type_checker_reads_every_section(tmp_path):
    """mypy knows each section's and each method's option types from the config: a misspelt option and a
    wrong type are errors, the right ones are not (~1 min: mypy reads the package)."""
    import shutil
    import subprocess
    import sys

    if (
        shutil.which("mypy") is None
        and subprocess.run([sys.executable, "-m", "mypy", "--version"]).returncode
    ):
        pytest.skip("mypy is not installed (pip install -e .[dev])")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "from fedllm.config import load_config\n\n"
        "cfg = load_config()\n"
        "lr: float = cfg.aggregation.floral.router_lr\n"
        "robust: str = cfg.aggregation.fedit.robust\n"
        "bits: str = cfg.comm.upload\n"
        "bad = cfg.aggregation.floral.router_lrr\n"
        "wrong: str = cfg.comm.error_feedback\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
         "--ignore-missing-imports", str(snippet)],
        cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["7", "8"], out.stdout
    assert "router_lrr" in errors[0] and '"bool"' in errors[1]


@pytest.mark.parametrize(
    ("name", "option", "value", "attribute"),
    [("fedit", "robust", "median", "robust"), ("fedit", "trim_fraction", 0.25, "trim_fraction"),
     ("fedit", "download_budget_mb", 0.5, "budget_mb"), ("flexlora", "download_budget_mb", 0.5, "budget_mb"),
     ("florist", "download_budget_mb", 0.5, "budget_mb"), ("fedex", "catchup_window", 3, "catchup_window"),
     ("flora", "catchup_window", 3, "catchup_window"), ("florist", "catchup_window", 3, "catchup_window")],
)  # fmt: skip
def test_each_moved_option_reaches_its_strategy(name, option, value, attribute):
    from fedllm.aggregation import strategy_from_config

    cfg = load_config(
        None,
        [f"aggregation.name={name}", f"aggregation.{name}.{option}={value}", "lora.trainable_modules=[]"],
    )
    assert getattr(strategy_from_config(cfg.aggregation), attribute) == value


def test_a_feature_without_its_typed_section_fails_at_import():
    from types import SimpleNamespace

    from fedllm.config import Config, _check_features
    from fedllm.features import FEATURES

    _check_features(Config, FEATURES)
    with pytest.raises(TypeError, match="feature section 'newcomer'"):
        _check_features(Config, [*FEATURES, SimpleNamespace(section="newcomer", options=dict)])


def test_a_merging_strategy_must_keep_a_catchup_window():
    """A strategy that merges into the base without MergingOptions would leave the server no merges for the
    clients that missed some (every returning client would download the whole residual): refused at import."""
    from fedllm.aggregation import STRATEGIES
    from fedllm.aggregation.flora import FLoRA

    with pytest.raises(TypeError, match="must subclass MergingOptions"):

        class Merger(FLoRA):
            name = "merger_without_window"
            options = None

    assert "merger_without_window" not in STRATEGIES


def test_an_option_of_other_methods_names_them():
    with pytest.raises(ConfigError, match=re.escape(
        "flora has no option 'download_budget_mb'; it is an option of aggregation.fedit.download_budget_mb, "
        "aggregation.flexlora.download_budget_mb, aggregation.florist.download_budget_mb")):  # fmt: skip
        load_config(None, ["aggregation.name=flora", "aggregation.flora.download_budget_mb=1"])
