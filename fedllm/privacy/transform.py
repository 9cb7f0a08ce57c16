"""The client side of DP-FedAvg: an upload transform that clips what leaves a site (and noises it in local
mode).

What is clipped is the whole change the site uploads, in the aggregation space (B with its scale folded
in): every factor it sends (FedSA-LoRA: A; FFA-LoRA: B), its dense modules, and every extra that is a
parameter of the model (the hook's ``shared_extras``: FedSA-LoRA's shared B, measured from zero since the
server never saw it). An extra that is not a parameter would leave without noise: the transform refuses
it (that client's failure for the round), whatever the config rules let through.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedllm.checks import clip_
from fedllm.factors import LoraFactors
from fedllm.protocol import ClientUpdate, UploadContext, UploadTransform, leading_block, seeded_generator


class ClipAndNoise(UploadTransform):
    """Clip the upload's change to ``clip_norm`` (and add Gaussian noise of ``noise_std``: local mode).

    Noise is drawn in one fixed order (every A, every B, the dense modules, the shared extras) from a
    generator of ``noise_seed`` (OS randomness when -1), the round and the client.
    """

    def __init__(self, clip_norm: float, noise_std: float = 0.0, noise_seed: int = -1) -> None:
        self.clip_norm, self.noise_std, self.noise_seed = clip_norm, noise_std, noise_seed

    def apply(self, update: ClientUpdate, ctx: UploadContext) -> ClientUpdate:
        start, started = ctx.start, ctx.started
        unknown = sorted(k for k in update.extras if not k.startswith(ctx.shared_extras))
        if unknown:
            raise RuntimeError(
                f"privacy: extra {unknown[0]!r} would leave the site without noise; it is not a parameter "
                "that the clip covers"
            )
        dA = {k: f.A - started[k].A for k, f in update.factors.items() if f.A.numel()}
        dB = {
            k: (f.B - started[k].with_scale(f.scale).B) * f.scale
            for k, f in update.factors.items()
            if f.B.numel()
        }
        dD = {k: t - start.dense[k] for k, t in update.dense.items()}
        base = {k: _downloaded(start.extras, k, t) for k, t in update.extras.items()}
        dE = {k: t - base[k] for k, t in update.extras.items()}
        changes = [*dA.values(), *dB.values(), *dD.values(), *dE.values()]
        clip_(changes, self.clip_norm)
        if self.noise_std > 0:
            gen = seeded_generator(self.noise_seed, start.round, update.client_id, 1)
            for c in changes:
                c.add_(torch.randn(c.shape, generator=gen) * self.noise_std)
        factors = {}
        for k, f in update.factors.items():
            ref = started[k].with_scale(f.scale)
            A = ref.A + dA[k] if k in dA else f.A
            B = ref.B + dB[k] / f.scale if k in dB else f.B
            factors[k] = LoraFactors(A, B, f.scale)
        update.factors = factors
        update.dense = {k: start.dense[k] + d for k, d in dD.items()}
        update.extras = {k: base[k] + d for k, d in dE.items()}
        return update


def _downloaded(extras: dict[str, Tensor], name: str, sent: Tensor) -> Tensor:
    """What an uploaded extra's change is measured from: the download of the same name (zero if none), or its
    leading block when the client trains only that (Fed-SB: a rank-r_k client's r_k x r_k block of R)."""
    got = extras.get(name)
    return torch.zeros_like(sent) if got is None else leading_block(got, sent).to(sent.dtype)
