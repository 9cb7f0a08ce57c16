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

from fedllm.checks import clip_
from fedllm.factors import LoraFactors
from fedllm.protocol import (
    ClientUpdate,
    UploadContext,
    UploadTransform,
    extra_reference,
    seeded_generator,
    upload_changes,
)


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
        changes = upload_changes(update, ctx)
        clip_(list(changes.values()), self.clip_norm)
        if self.noise_std > 0:
            gen = seeded_generator(self.noise_seed, start.round, update.client_id, 1)
            for c in changes.values():
                c.add_(torch.randn(c.shape, generator=gen) * self.noise_std)
        factors = {}
        for k, f in update.factors.items():
            ref = started[k].with_scale(f.scale)
            A = ref.A + changes[f"A.{k}"] if f"A.{k}" in changes else f.A
            B = ref.B + changes[f"B.{k}"] / f.scale if f"B.{k}" in changes else f.B
            factors[k] = LoraFactors(A, B, f.scale)
        update.factors = factors
        update.dense = {k: start.dense[k] + changes[f"dense.{k}"] for k in update.dense}
        update.extras = {
            k: extra_reference(start.extras, k, t) + changes[f"extras.{k}"] for k, t in update.extras.items()
        }
        return update
