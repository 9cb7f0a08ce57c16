"""Client-batched local training (``federation.client_batch = K``): K clients of a round in one forward.

In a simulated round every client trains on the same frozen base; only their small adapters differ. So K
clients' batches are stacked into one batch that goes through the base once, each row routed through its
own client's adapter: every LoRA layer computes the base projection for all rows, then each client's
``B_k A_k x`` on its own rows, as one batched matmul over the K adapters zero-padded to the largest rank
(exact: a padded row of A meets a padded column of B, both zero, so the padding adds nothing and gets no
gradient). A layer with hooks of its own (HetLoRA's pruning mask) or a LoRA bias computes each client
through its modules instead, so the hooks still fire. The loss is the sum of the clients' own mean losses;
their adapters are disjoint parameters, so each one's gradient is its own.

Each client keeps its own adapter slot (a peft adapter ``b<i>r<rank>``: clients of equal rank need
separate weights), optimizer, schedule, gradient clip, correction (SCAFFOLD), proximal pull (FedProx),
data order and dropout masks: the masks are drawn from its own generator, seeded as its lone training
seeds the global one, in the same order, with the shape its lone batch has (rows padded to the longest
client's batch are cut off before the draw). A client whose trajectory is the one it has alone is what
the equivalence tests check (tests/test_client_batch.py).

What cannot be batched is trained one client at a time, said once: an algorithm that takes several
forwards per step (Per-FedAvg), a strategy whose clients train parameters of their own (FLoRAL's
routers), dense trainable modules (one shared copy of embed_tokens would mix the clients' gradients: the
config refuses them with K > 1), a quantized base's residual adapter, the data-parallel layout (each
client's batches already split over processes) and per-client time budgets. Under ``accelerate launch``
with clients split over processes, each process batches its own share.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from fedllm.client.base import LocalResult, LocalRun
from fedllm.factors import lora_modules
from fedllm.model.modeling import RESIDUAL, peft_lora_config

log = logging.getLogger(__name__)


def slot_name(index: int, rank: int) -> str:
    """The peft adapter of the ``index``-th client of a batch, at ``rank``."""
    return f"b{index}r{rank}"


def why_not_batched(runtime) -> str | None:
    """None when this runtime's clients can train together, else why not (one line)."""
    if not runtime.algorithm.batchable:
        return f"client.algorithm={runtime.algorithm.name} takes several forwards per local step"
    if runtime.hook.local_params:
        return "the strategy's clients train parameters of their own (FLoRAL's routers)"
    if runtime.dense_names:
        return "lora.trainable_modules are trained by every client (one shared copy)"
    if RESIDUAL in runtime.model.peft_config:
        return "merges on this base are kept as a residual adapter"
    if runtime.layout.data_parallel or runtime.layout.deepspeed:
        return "the data layout splits each client's batches over processes (or DeepSpeed wraps the model)"
    if runtime.client_timeout_s:
        return "federation.client_timeout_s stops clients one by one"
    from peft.tuners.lora.layer import Linear

    cfg = next(iter(runtime.model.peft_config.values()))
    if getattr(cfg, "use_dora", False):
        return "DoRA layers"
    first = next(iter(runtime.model.peft_config))
    if any(type(m) is not Linear for m in lora_modules(runtime.model, first).values()):
        return "LoRA layers other than peft's plain Linear (a quantized base)"
    return None


def ensure_slot(model, name: str, rank: int, lora_cfg) -> None:
    """The adapter ``name`` of ``rank`` (made once; its weights are written at each switch-in)."""
    if name not in model.peft_config:
        model.add_adapter(name, peft_lora_config(rank, lora_cfg))


@dataclass
class _Span:
    slot: str
    row: int  # its first row in the stacked batch
    rows: int
    width: int  # its own batch's sequence length (the stacked batch is padded to the longest)
    generator: torch.Generator  # its dropout masks


class Routing:
    """Every LoRA layer's forward replaced, while open, by one that routes each row through its client's
    adapter (see module docstring); :attr:`spans` says whose rows are where for the next forward."""

    def __init__(self, model, adapter: str) -> None:
        self.modules = list(lora_modules(model, adapter).values())
        self.spans: list[_Span] = []
        self._scale_cache: dict = {}
        for m in self.modules:
            m.forward = self._forward_of(m)

    def close(self) -> None:
        for m in self.modules:
            del m.forward  # back to the class's forward

    def _forward_of(self, m):
        def forward(x: Tensor, *args, **kwargs) -> Tensor:
            result = m.base_layer(x, *args, **kwargs)
            return result + self._lora(m, x).to(result.dtype)

        return forward

    def _inputs(self, m, x: Tensor) -> tuple[list[Tensor], bool]:
        """Each client's rows, dropped out as its lone forward would be (its own mask, its own width), and
        whether they are plain slices of ``x`` (no dropout, no cast)."""
        out, plain = [], True
        for s in self.spans:
            xk = x[s.row : s.row + s.rows]
            drop = m.lora_dropout[s.slot]
            p = getattr(drop, "p", 0.0)
            if drop.training and p > 0:
                own = xk[:, : s.width]
                noise = torch.empty(own.shape, dtype=own.dtype, device=own.device)
                noise.bernoulli_(1 - p, generator=s.generator).div_(1 - p)
                xk = torch.cat([own * noise, xk[:, s.width :]], dim=1)
                plain = False
            if xk.dtype != m.lora_A[s.slot].weight.dtype:
                xk, plain = xk.to(m.lora_A[s.slot].weight.dtype), False
            out.append(xk)
        return out, plain

    def _lora(self, m, x: Tensor) -> Tensor:
        xs, plain = self._inputs(m, x)
        slots = [s.slot for s in self.spans]
        hooked = any(
            mod._forward_hooks or mod._forward_pre_hooks or getattr(mod, "bias", None) is not None
            for s in slots
            for mod in (m.lora_A[s], m.lora_B[s])
        )
        if hooked:  # through the modules, so that their hooks fire
            ys = [m.lora_B[s](m.lora_A[s](xk)) * m.scaling[s] for s, xk in zip(slots, xs, strict=True)]
            return torch.cat(ys, dim=0)
        k, t, d = len(slots), x.shape[1], x.shape[-1]
        even = len({s.rows for s in self.spans}) == 1
        if even and plain:
            flat = x.reshape(k, -1, d)  # the rows already lie client by client: a view
        elif even:
            flat = torch.stack([xk.reshape(-1, d) for xk in xs])
        else:
            flat = pad_sequence([xk.reshape(-1, d) for xk in xs], batch_first=True)  # K x rows*T x in
        a_list = [m.lora_A[s].weight for s in slots]
        b_list = [m.lora_B[s].weight for s in slots]
        if len({w.shape[0] for w in a_list}) == 1:  # one rank: a plain stack
            a, b = torch.stack(a_list), torch.stack(b_list)  # K x r x in, K x out x r
        else:  # zero-padded to the largest rank (exact: see module docstring)
            a = pad_sequence(a_list, batch_first=True)
            b = pad_sequence([w.T for w in b_list], batch_first=True).transpose(1, 2)
        scale = self._scales(m, slots, flat)  # folded into B (K x out x r): cheaper than scaling the output
        y = torch.bmm(torch.bmm(flat, a.transpose(1, 2)), b.transpose(1, 2) * scale)
        if even:
            return y.reshape(k * self.spans[0].rows, t, -1)
        return torch.cat([y[i, : s.rows * t].reshape(s.rows, t, -1) for i, s in enumerate(self.spans)], dim=0)

    def _scales(self, m, slots: list[str], like: Tensor) -> Tensor:
        key = (id(m), tuple(slots), like.dtype, like.device)
        cached = self._scale_cache.get(key)
        if cached is None:
            values = [float(m.scaling[s]) for s in slots]
            cached = torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, 1, 1)
            self._scale_cache[key] = cached
        return cached


def _stack(batches: list[dict[str, Tensor]], pad_id: int) -> dict[str, Tensor]:
    """The clients' batches as one, right-padded to the longest (padding is masked in attention and loss)."""
    width = max(b["input_ids"].shape[1] for b in batches)

    def pad(t: Tensor, value: int) -> Tensor:
        return F.pad(t, (0, width - t.shape[1]), value=value)

    return {
        "input_ids": torch.cat([pad(b["input_ids"], pad_id) for b in batches]),
        "attention_mask": torch.cat([pad(b["attention_mask"], 0) for b in batches]),
    }


def client_losses(logits: Tensor, batches: list[dict[str, Tensor]]) -> list[Tensor]:
    """Each client's mean next-token loss over its own response tokens, as the model computes it alone.

    The token losses of the whole stacked batch in one cross-entropy, then each client's sum over its
    rows divided by its own token count: slicing the logits per client would cost a full-size gradient
    per client in the backward.
    """
    width = logits.shape[1]
    labels = torch.cat([F.pad(b["labels"], (0, width - b["labels"].shape[1]), value=-100) for b in batches])
    labels = labels[:, 1:].to(logits.device)
    tokens = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=-100,
        reduction="none",
    ).view(labels.shape)
    per_row, counts = tokens.sum(1), (labels != -100).sum(1)
    out, row = [], 0
    for b in batches:
        n = b["labels"].shape[0]
        out.append(per_row[row : row + n].sum() / counts[row : row + n].sum())
        row += n
    return out


def train_together(runtime, jobs: list, algos: list, accelerator) -> list[tuple[LocalResult, float]]:
    """Train ``jobs`` (switched in, each in its own slot) side by side; each one's result and seconds.

    Clients with fewer local steps leave the batch when theirs are done; gradient accumulation takes
    ``client.grad_accum`` stacked micro-batches per step.
    """
    model = runtime.model
    pad_id = runtime.tokenizer.pad_token_id
    runs = [
        LocalRun(a, j.params, j.plan, j.algo_state, j.start.algo) for a, j in zip(algos, jobs, strict=True)
    ]
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    for run in runs:
        if device.type != "cpu":
            run.generator = torch.Generator(device=device).manual_seed(run.plan.seed)
    routing = Routing(model, jobs[0].adapter)
    steps = max(j.plan.steps for j in jobs)
    accum = jobs[0].plan.grad_accum
    t0 = time.perf_counter()
    autocast = accelerator.autocast if accelerator is not None else contextlib.nullcontext
    try:
        model.train()
        for step in range(steps):
            active = [k for k, j in enumerate(jobs) if step < j.plan.steps]
            for k in active:
                runs[k].zero_grad()
            totals = dict.fromkeys(active, 0.0)
            for _ in range(accum):
                batches = [next(jobs[k].batches) for k in active]
                routing.spans, row = [], 0
                for k, b in zip(active, batches, strict=True):
                    n, width = b["input_ids"].shape
                    routing.spans.append(_Span(jobs[k].adapter, row, n, width, runs[k].generator))
                    row += n
                stacked = {key: v.to(device) for key, v in _stack(batches, pad_id).items()}
                with autocast():
                    logits = model(**stacked).logits
                losses = client_losses(logits, batches)
                (sum(losses) / accum).backward()
                for k, loss in zip(active, losses, strict=True):
                    totals[k] += loss.item() / accum
            for k in active:
                algos[k].after_backward(jobs[k].params)
                runs[k].step(totals[k])
    finally:
        routing.close()
        for run in runs:
            run.close()
        model.eval()
    elapsed = time.perf_counter() - t0
    return [(run.result(), elapsed) for run in runs]


def batches_of(items: list, k: int) -> Iterator[list]:
    for i in range(0, len(items), k):
        yield items[i : i + k]
