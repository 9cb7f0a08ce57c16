"""Client-batched local training (``federation.client_batch = K``): K clients of a round in one forward.

In a simulated round every client trains on the same frozen base; only their small adapters differ. So K
clients' batches are stacked into one batch that goes through the base once, each row routed through its
own client's adapter: every LoRA layer computes the base projection for all rows, then adds each client's
``B_k A_k x`` on its own rows, at its own rank, in one autograd node with its backward written out
(:class:`_RoutedLoRA`). A layer with hooks of its own (HetLoRA's pruning mask) or a LoRA bias computes
each client through its modules instead, so the hooks still fire. The loss is the sum of the clients'
own mean losses; their adapters are disjoint parameters, so each one's gradient is its own.

Each client keeps its own adapter slot (a peft adapter ``b<i>r<rank>``: clients of equal rank need
separate weights), optimizer, schedule, gradient clip, correction (SCAFFOLD), proximal pull (FedProx),
data order and dropout masks: the masks are drawn from its own generator, seeded as its lone training
seeds the global one, in the same order, with the shape its lone batch has (rows padded to the longest
client's batch are cut off before the draw). A client whose trajectory is the one it has alone is what
the equivalence tests check (tests/test_client_batch.py). That holds on the CPU, where ``F.dropout`` is
``bernoulli_`` on the global generator; on CUDA ``F.dropout`` runs a fused kernel with its own Philox
stream, so there the masks have the lone path's distribution but not its values (tests/test_gpu.py).

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

from fedllm.client.base import LocalResult, LocalRun
from fedllm.factors import lora_modules
from fedllm.model.modeling import RESIDUAL, peft_lora_config

log = logging.getLogger(__name__)


def slot_name(index: int, rank: int) -> str:
    """The peft adapter of the ``index``-th client of a batch, at ``rank``."""
    return f"b{index}r{rank}"


def why_not_batched_model(model) -> str | None:
    """None when ``model``'s LoRA layers can be routed per client (the runtime asks this after its own
    reasons, ``ClientRuntime.why_not_batched``), else why not (one line)."""
    if RESIDUAL in model.peft_config:
        return "merges on this base are kept as a residual adapter"
    from peft.tuners.lora.layer import Linear

    cfg = next(iter(model.peft_config.values()))
    if getattr(cfg, "use_dora", False):
        return "DoRA layers"
    first = next(iter(model.peft_config))
    if any(type(m) is not Linear for m in lora_modules(model, first).values()):
        return "LoRA layers other than peft's plain Linear (a quantized base)"
    return None


def ensure_slot(model, name: str, rank: int, lora_cfg) -> None:
    """The adapter ``name`` of ``rank`` (made once; its weights are written at each switch-in)."""
    if name not in model.peft_config:
        model.add_adapter(name, peft_lora_config(rank, lora_cfg))


class _Masks:
    """A client's dropout-mask stream on the run's device: the stream its lone training draws from the global
    generator (seeded with its local work's seed), made at the first draw (a client without dropout needs
    none)."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed, self.device = seed, device
        self._generator: torch.Generator | None = None

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=self.device).manual_seed(self.seed)
        return self._generator


@dataclass
class _Span:
    slot: str
    row: int  # its first row in the stacked batch
    rows: int
    width: int  # its own batch's sequence length (the stacked batch is padded to the longest)
    masks: _Masks  # its dropout masks


class _RoutedLoRA(torch.autograd.Function):
    """``out += scale_k B_k A_k drop_k(x)`` on each client k's rows, in place: one autograd node per layer.

    Each client's products run at its own rank on its own rows (no stack zero-padded to the largest rank, no
    padded copies in the graph), and the backward is written out: with ``g`` the output's gradient on
    client k's rows and ``h = drop_k(x) A_k^T``: ``dB_k = s g^T h``, ``dh = s g B_k``,
    ``dA_k = dh^T drop_k(x)``, ``dx = drop_k(dh A_k)`` (the same mask, scaled). ``layer`` (a
    :class:`_Layer`) holds the adapters, scales, row ranges and masks of this forward.
    """

    @staticmethod
    def forward(ctx, out, x, layer, *weights):
        k = len(layer.scales)
        a_list, b_list = weights[:k], weights[k:]
        dtype = layer.dtype
        kind = x.device.type  # products in ``dtype`` whatever autocast would pick (a device may have none)
        with (
            torch.autocast(kind, enabled=False)
            if torch.amp.is_autocast_available(kind)
            else contextlib.nullcontext()
        ):
            flat = x.reshape(-1, x.shape[-1])
            of = out.view(-1, out.shape[-1])
            xs, hs = [], []
            for (lo, hi), a, b, s, noise in zip(
                layer.bounds, a_list, b_list, layer.scales, layer.noise, strict=True
            ):
                xk = flat[lo:hi].to(dtype)
                if noise is not None:
                    xk = xk * noise
                h = torch.mm(xk, a.to(dtype).T)
                delta = torch.mm(h, b.to(dtype).T)
                of[lo:hi].add_(delta.to(out.dtype), alpha=s)
                xs.append(xk)
                hs.append(h)
        ctx.mark_dirty(out)
        ctx.save_for_backward(*xs, *hs, *weights)
        ctx.layer, ctx.x_shape, ctx.x_dtype = layer, x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        k = len(layer.scales)
        saved = ctx.saved_tensors
        xs, hs, a_list, b_list = saved[:k], saved[k : 2 * k], saved[2 * k : 3 * k], saved[3 * k :]
        gf = grad.reshape(-1, grad.shape[-1])
        need_x = ctx.needs_input_grad[1]
        gx = gf.new_empty((gf.shape[0], ctx.x_shape[-1]), dtype=ctx.x_dtype) if need_x else None
        ga, gb = [], []
        for i, ((lo, hi), s, noise) in enumerate(zip(layer.bounds, layer.scales, layer.noise, strict=True)):
            a, b = a_list[i], b_list[i]
            g = gf[lo:hi].to(layer.dtype)
            dh = torch.mm(g, b.to(layer.dtype)).mul_(s)
            gb.append(torch.mm(g.T, hs[i]).mul_(s).to(b.dtype) if ctx.needs_input_grad[3 + k + i] else None)
            ga.append(torch.mm(dh.T, xs[i]).to(a.dtype) if ctx.needs_input_grad[3 + i] else None)
            if need_x and noise is None and gx.dtype == layer.dtype:
                torch.mm(dh, a.to(layer.dtype), out=gx[lo:hi])
            elif need_x:
                dx = torch.mm(dh, a.to(layer.dtype))
                gx[lo:hi] = dx if noise is None else dx.mul_(noise)
        return (grad, None if gx is None else gx.view(ctx.x_shape), None, *ga, *gb)


@dataclass
class _Layer:
    """One LoRA layer's part of a routed forward (its adapters are the function's own inputs, so that
    autograd sees them): each client's scale, flattened row range and dropout mask (None: no dropout), and
    the dtype its products run in."""

    scales: list[float]
    bounds: list[tuple[int, int]]
    noise: list[Tensor | None]
    dtype: torch.dtype


def checkpointed(model) -> bool:
    """Whether any module of ``model`` recomputes its forward in the backward: the modules' own
    ``gradient_checkpointing`` flags, which ``gradient_checkpointing_enable`` sets on each block. Not the
    model's ``is_gradient_checkpointing`` property, deprecated in transformers 5 and gone in 6: had the replay
    keyed on it, its removal would silently switch the replay off and batched gradients under checkpointing
    and dropout would be wrong again (1.42 relative)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


class Routing:
    """Every LoRA layer's forward replaced, while open, by one that routes each row through its client's
    adapter (see module docstring); :attr:`spans` says whose rows are where for the next forward."""

    def __init__(self, model, adapter: str) -> None:
        self.modules = list(lora_modules(model, adapter).values())
        # gradient checkpointing recomputes a layer's forward in the backward: its masks are then replayed
        self.replays = checkpointed(model)
        self._spans: list[_Span] = []
        # per layer: each client's generator state when the layer drew its masks in this forward
        self._drawn: dict[int, list[Tensor | None]] = {}
        self._per_slots: dict[tuple[str, ...], dict[int, tuple]] = {}
        for m in self.modules:
            m.forward = self._forward_of(m)

    @property
    def spans(self) -> list[_Span]:
        """The next forward's clients, in the stacked batch's order."""
        return self._spans

    @spans.setter
    def spans(self, spans: list[_Span]) -> None:
        self._spans = spans
        self._drawn = {}  # a new forward: every layer draws afresh

    def close(self) -> None:
        for m in self.modules:
            del m.forward  # back to the class's forward

    def _adapters(self, m, slots: tuple[str, ...]) -> tuple:
        """(hooked, A's, B's, scales) of layer ``m`` for these slots, looked up once per set of slots."""
        cache = self._per_slots.setdefault(slots, {})
        got = cache.get(id(m))
        if got is None:
            mods = [(m.lora_A[s], m.lora_B[s]) for s in slots]
            hooked = any(
                mod._forward_hooks or mod._forward_pre_hooks or getattr(mod, "bias", None) is not None
                for pair in mods
                for mod in pair
            )
            got = (
                hooked,
                [a.weight for a, _ in mods],
                [b.weight for _, b in mods],
                [float(m.scaling[s]) for s in slots],
            )
            cache[id(m)] = got
        return got

    def _forward_of(self, m):
        def forward(x: Tensor, *args, **kwargs) -> Tensor:
            result = m.base_layer(x, *args, **kwargs)
            slots = tuple(s.slot for s in self.spans)
            hooked, a_list, b_list, scales = self._adapters(m, slots)
            if hooked:  # through the modules, so that their hooks fire
                noise = self._noise(m, x, x.dtype)
                return result + self._through_modules(m, x, slots, noise).to(result.dtype)
            kind = x.device.type
            autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
            dtype = torch.get_autocast_dtype(kind) if autocast else a_list[0].dtype
            width = x.shape[1]
            bounds = [(s.row * width, (s.row + s.rows) * width) for s in self.spans]
            layer = _Layer(scales, bounds, self._noise(m, x, dtype), dtype)
            return _RoutedLoRA.apply(result, x, layer, *a_list, *b_list)

        return forward

    def _noise(self, m, x: Tensor, dtype) -> list[Tensor | None]:
        """Each client's dropout mask over its rows of the stacked batch (scaled by 1 / (1 - p); ones past its
        own width), drawn from its own generator in its lone batch's shape, so that it is the one its lone
        forward draws; None for a client without dropout.

        Under gradient checkpointing a layer that draws a second time in one forward is being recomputed:
        torch's checkpoint restores the global generator around a recompute, which is what a lone forward
        draws from, but not a client's own. So there the first draw records each generator's state and a
        recompute draws again from it, then puts the generator back where the forward left it: the backward
        then sees the masks the forward used, as it does alone."""
        out = []
        replay = self._drawn.get(id(m)) if self.replays else None
        states = self._drawn.setdefault(id(m), []) if self.replays and replay is None else None
        for i, s in enumerate(self.spans):
            drop = m.lora_dropout[s.slot]
            p = getattr(drop, "p", 0.0)
            if not (drop.training and p > 0):
                out.append(None)
                if states is not None:
                    states.append(None)
                continue
            generator = s.masks.generator
            own = torch.empty((s.rows, s.width, x.shape[-1]), dtype=x.dtype, device=x.device)
            if replay is not None:  # the recompute draws from where the forward drew, then goes back
                now = generator.get_state()
                generator.set_state(replay[i])
            elif states is not None:
                states.append(generator.get_state())
            own.bernoulli_(1 - p, generator=generator).div_(1 - p)
            if replay is not None:
                generator.set_state(now)
            full = torch.ones((s.rows, x.shape[1], x.shape[-1]), dtype=dtype, device=x.device)
            full[:, : s.width] = own
            out.append(full.view(-1, x.shape[-1]))
        return out

    def _through_modules(self, m, x: Tensor, slots: tuple[str, ...], noise: list[Tensor | None]) -> Tensor:
        """Each client's rows through its own lora_A / lora_B modules (a layer with hooks or a bias), dropped
        out by its mask from :meth:`_noise` (drawn in ``x``'s dtype, as its lone forward drops ``x``)."""
        flat = x.reshape(-1, x.shape[-1])
        width = x.shape[1]
        ys = []
        for s, slot, mask in zip(self.spans, slots, noise, strict=True):
            xk = flat[s.row * width : (s.row + s.rows) * width]
            xk = (xk if mask is None else xk * mask).view(s.rows, width, -1).to(m.lora_A[slot].weight.dtype)
            ys.append(m.lora_B[slot](m.lora_A[slot](xk)) * m.scaling[slot])
        return torch.cat(ys, dim=0)


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


def train_together(
    model, pad_id: int, jobs: list, algos: list, accelerator
) -> list[tuple[LocalResult, float]]:
    """Train ``jobs`` (switched in by the runtime, each in its own slot of ``model``) side by side; each one's
    result and seconds. The runtime calls this and never the reverse: each job carries the per-client
    session state (its parameters, local work, algorithm state, batches), and nothing here reads the runtime.

    Clients with fewer local steps leave the batch when theirs are done; gradient accumulation takes
    ``client.grad_accum`` stacked micro-batches per step.
    """
    runs = [
        LocalRun(a, j.params, j.work, j.algo_state, j.start.algo) for a, j in zip(algos, jobs, strict=True)
    ]
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    masks = [_Masks(run.work.seed, device) for run in runs]
    routing = Routing(model, jobs[0].adapter)
    steps = max(j.work.steps for j in jobs)
    accum = jobs[0].work.grad_accum
    t0 = time.perf_counter()
    autocast = accelerator.autocast if accelerator is not None else contextlib.nullcontext
    try:
        model.train()
        for step in range(steps):
            active = [k for k, j in enumerate(jobs) if step < j.work.steps]
            for k in active:
                runs[k].zero_grad()
            totals = dict.fromkeys(active, 0.0)
            for _ in range(accum):
                batches = [next(jobs[k].batches) for k in active]
                spans, row = [], 0
                for k, b in zip(active, batches, strict=True):
                    n, width = b["input_ids"].shape
                    spans.append(_Span(jobs[k].adapter, row, n, width, masks[k]))
                    row += n
                stacked = {key: v.to(device) for key, v in _stack(batches, pad_id).items()}
                routing.spans = spans
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
