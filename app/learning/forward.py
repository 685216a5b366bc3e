"""How a batch of training sequences becomes per-token log-probabilities under the policy.

The model's inputs are built on the host from the sequences' token ids and PNG pictures: padded ids, the loss
mask, the processed pictures (from app.learning.speedups.picture_cache when it is on) and the 3-D rotary positions
(app.learning.speedups.rope_positions). The forward keeps logits only where a trained token is predicted, and
scores every token under the distribution the engine sampled from (vision tokens forbidden, at the sampling
temperature), so the trainer's and the engine's log-probabilities compare token for token.
"""

from __future__ import annotations

import contextlib

import torch
from peft.helpers import disable_input_dtype_casting

from app.learning.batch import TrainItem
from app.learning.speedups.lora_forward import fuse_lora_layers
from app.learning.speedups.picture_cache import PictureCache
from app.learning.speedups.rope_positions import batch_positions
from app.learning.speedups.vision_cache import VisionCache
from app.rollout.encoding import ChatCodec, png_to_image
from app.rollout.engines.base import logprobs_of


class PolicyForward:
    def __init__(
        self,
        model,
        codec: ChatCodec,
        device: torch.device,
        temperature: float,
        compute_dtype: torch.dtype,
        pictures: PictureCache | None = None,
        vision_cache: VisionCache | None = None,
    ):
        """temperature: the rollouts' sampling temperature, the default of every forward. compute_dtype: the model's
        (model.dtype, the engines'): the LoRA, and whole modules that train, compute in it from float32 masters."""
        self.model, self.codec, self.device, self.temperature = model, codec, device, temperature
        self.compute_dtype = compute_dtype
        fuse_lora_layers(model)  # app.learning.speedups.lora_forward
        self.pictures, self.vision_cache = pictures, vision_cache
        self.forbidden = codec.forbidden_ids()
        # rotary positions made on the host (app.learning.speedups.rope_positions); False leaves them to the
        # model's own per-sequence loop
        self.host_positions = True

    def inputs(self, batch: list[TrainItem]) -> tuple[dict, torch.Tensor, torch.Tensor]:
        width = max(len(it.token_ids) for it in batch)
        ids = torch.full((len(batch), width), self.codec.pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        mask = torch.zeros(len(batch), width)
        for row, it in enumerate(batch):
            n = len(it.token_ids)
            ids[row, :n], attention[row, :n], mask[row, :n] = it.token_ids, 1, it.loss_mask
        inputs = {"input_ids": ids, "attention_mask": attention, "mm_token_type_ids": self.codec.mm_token_type_ids(ids)}
        pngs = [png for it in batch for png in it.images]
        if self.pictures is not None:
            inputs.update(self.pictures.vision_inputs(pngs))
        else:
            on_gpu = self.device if self.device.type == "cuda" else None
            inputs.update(self.codec.vision_inputs([png_to_image(png) for png in pngs], device=on_gpu))
        if self.host_positions:  # the model's own rotary positions loop over the batch on the device; same values
            grids = inputs["image_grid_thw"].tolist() if pngs else []
            inputs["position_ids"] = batch_positions(
                [it.token_ids.numpy() for it in batch], width, self.codec.image_pad_id, grids, self.codec.merge
            )
        return {k: v.to(self.device) for k, v in inputs.items()}, ids, mask

    def mixed_precision(self) -> contextlib.AbstractContextManager:
        """The model's forward with every LoRA layer in compute_dtype: autocast casts the float32 LoRA weights
        (small) for each product instead of PEFT casting each layer's input activations (large) up to float32."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.device.type, dtype=self.compute_dtype))
        stack.enter_context(disable_input_dtype_casting(self.model))
        return stack

    def token_logprobs(
        self,
        batch: list[TrainItem],
        with_grad: bool,
        adapter: bool = True,
        temperature: float | None = None,
        entropy_grad: bool = False,
    ):
        """(logp, entropy, mask, positions): per trained position, under the sampling distribution
        (rollout.temperature; SFT passes 1.0: it fits the model's own distribution, whatever the sampling).
        The entropy keeps its graph with `entropy_grad` (the entropy bonus), else it is a measurement.

        Only positions whose next token is trained get logits (`logits_to_keep`), which keeps the
        [batch, positions, vocab] tensor small for a large vocabulary.
        """
        inputs, ids, mask = self.inputs(batch)
        wanted = mask[:, 1:].any(dim=0).nonzero().squeeze(-1)  # positions t-1 that predict a trained token t
        temperature = self.temperature if temperature is None else temperature
        ctx = torch.enable_grad() if with_grad else torch.no_grad()
        pictures = contextlib.nullcontext()
        if self.vision_cache is not None:
            pictures = self.vision_cache.serving([PictureCache.key(png) for it in batch for png in it.images])
        with ctx, pictures:
            with self.mixed_precision():
                if adapter:
                    out = self.model(**inputs, logits_to_keep=wanted.to(self.device), use_cache=False)
                else:
                    with self.model.disable_adapter():
                        out = self.model(**inputs, logits_to_keep=wanted.to(self.device), use_cache=False)
            logits = out.logits.float()
            kept_mask = mask[:, wanted + 1]
            # Untrained positions may hold image pads, which are forbidden (-inf): score a harmless id there.
            targets = torch.where(kept_mask > 0, ids[:, wanted + 1], self.codec.pad_id).to(self.device)
            logp = logprobs_of(logits, targets, temperature, self.forbidden)
            entropy = None
            if adapter:
                keep_graph = entropy_grad and with_grad
                with torch.enable_grad() if keep_graph else torch.no_grad():
                    masked = (logits if keep_graph else logits.detach()).clone()
                    masked[..., self.forbidden] = float("-inf")
                    dist_logp = torch.log_softmax(masked / temperature, dim=-1)
                    entropy = -(dist_logp.exp() * torch.nan_to_num(dist_logp, neginf=0.0)).sum(-1)
        return logp, entropy, kept_mask.to(self.device), wanted
