"""The learner's batch layout and log-prob forward, as pure functions of a model and a batch.

`collate` lays prompt + response sequences out as one right-padded `TrainBatch` (images through
the judge's processor); `forward_logprobs` runs a model over it and returns the per-token
log-probs of the responses (of the logits divided by the rollout's temperature) and their
entropies, projecting the response positions through the output embedding a chunk at a time,
and forwarding each distinct prompt once when rows share it (`can_share_prefix`);
`forwarded_positions` counts what a forward ran through the model. The learner
(`pjray.rl.learner`) and the tests of served against learner log-probs use them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from pjray.models.families import family_of, token_types
from pjray.models.loading import (
    ban_tokens,
    continued_positions,
    placeholder_ids,
    processor_inputs,
    prompt_positions,
    truncate_logits,
)
from pjray.rl.grpo import entropy_from_logits, token_logprobs
from pjray.types import Experience, TrainBatch

if TYPE_CHECKING:
    from transformers.processing_utils import ProcessorMixin

__all__ = [
    "LOGIT_CHUNK_TOKENS",
    "TokenStats",
    "can_share_prefix",
    "collate",
    "forward_logprobs",
    "forwarded_positions",
    "model_inputs",
    "take_rows",
]

# Response positions projected through the output embedding at once: a forward or backward of
# `forward_logprobs` holds one [C, V] block of logits (plus its float32 temporaries) at a time.
# At V = 152k and C = 1024 that is ~0.3 GB in bf16, where all of a 16k-token response's are ~5 GB.
LOGIT_CHUNK_TOKENS = 1024


class TokenStats(NamedTuple):
    """What the learner reads of each trained response position's distribution besides the
    label's log-prob, taken from the same chunks of logits (no [N, V] tensor is returned).

    Both are [N], in the row-major order of the positions where response_mask[:, 1:] > 0, and
    detached: entropy (float32) of softmax(logits / temperature) with the banned ids out, greedy
    (long) its argmax.
    """

    entropy: Tensor
    greedy: Tensor


def collate(processor: ProcessorMixin, experiences: Sequence[Experience], pad_to: int | None = None) -> TrainBatch:
    """Model inputs for prompt + response sequences, right-padded to one length.

    Each distinct prompt goes through the processor once (it expands each image placeholder into
    the image's tokens), the response ids are appended, and each row is right-padded. Right
    padding keeps every real token at the position it has in an unpadded sequence, for 1-D RoPE
    and for Qwen-VL's M-RoPE alike (the model computes M-RoPE positions over the attended tokens
    only).

    Args:
        processor: the judge's processor (`pjray.models.loading.load_processor`).
        experiences: B sequences; `prompt_text` holds one placeholder iff `image` is set.
        pad_to: pad every row to exactly this many tokens (ValueError if one is longer);
            None pads to the longest row.

    Returns:
        TrainBatch with input_ids / attention_mask / response_mask / old_logprobs [B, T]
        (response_mask is 1 on the response tokens that `loss_mask` keeps; old_logprobs holds
        the given values on response positions, NaN where an experience has none, meaning "use
        the current policy"), advantages [B], per-row image tensors (`TrainBatch.vision`; {} for
        rows without an image), ref_logprobs / rollout_logprobs [B, T] when any
        experience has them (NaN on the response positions of those that do not), prompt_lens
        [B] and prompt_group [B] (the first row with the same prompt text and image).
    """
    if not experiences:
        raise ValueError("collate: no experiences")
    for i, e in enumerate(experiences):
        n = len(e.response_ids)
        for field_name in ("old_logprobs", "ref_logprobs", "rollout_logprobs", "loss_mask"):
            values = getattr(e, field_name)
            if values is not None and len(values) != n:
                raise ValueError(f"experience {i}: {field_name} has {len(values)} values for {n} response tokens")

    pad_id = processor.tokenizer.pad_token_id
    family = family_of(processor)
    first_row: dict[tuple[str, bytes | None], int] = {}
    prompt_group = [first_row.setdefault((e.prompt_text, e.image), i) for i, e in enumerate(experiences)]
    encoded: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}  # first row -> (prompt ids, images)
    for i in sorted(set(prompt_group)):
        e = experiences[i]
        enc = processor_inputs(processor, [e.prompt_text], [e.image])
        images = family.row_vision(enc) if family is not None and e.image is not None else {}
        encoded[i] = (enc["input_ids"][0][enc["attention_mask"][0].bool()], images)

    rows: list[Tensor] = []
    prompt_lens: list[int] = []
    for i, e in enumerate(experiences):
        prompt = encoded[prompt_group[i]][0]
        response = torch.tensor(e.response_ids, dtype=torch.long)
        row = torch.cat([prompt, response])
        if row.numel() == 0:
            # A row with no attended token can make attention produce NaN, which 0 * NaN would
            # carry into the loss; one attended pad token keeps the row harmless.
            row = torch.tensor([pad_id], dtype=torch.long)
        rows.append(row)
        prompt_lens.append(prompt.numel())

    longest = max(r.numel() for r in rows)
    if pad_to is not None and longest > pad_to:
        raise ValueError(f"collate: a sequence has {longest} tokens, more than pad_to={pad_to}")
    length = longest if pad_to is None else pad_to
    batch_size = len(experiences)

    input_ids = torch.full((batch_size, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, length, dtype=torch.long)
    response_mask = torch.zeros(batch_size, length, dtype=torch.float32)
    old_logprobs = torch.zeros(batch_size, length, dtype=torch.float32)
    optional = {
        name: torch.zeros(batch_size, length, dtype=torch.float32)
        for name in ("ref_logprobs", "rollout_logprobs")
        if any(getattr(e, name) is not None for e in experiences)
    }
    for i, (e, row, start) in enumerate(zip(experiences, rows, prompt_lens)):
        input_ids[i, : row.numel()] = row
        attention_mask[i, : row.numel()] = 1
        end = start + len(e.response_ids)
        response_mask[i, start:end] = 1.0 if e.loss_mask is None else torch.tensor(e.loss_mask, dtype=torch.float32)
        for name, values in [("old_logprobs", old_logprobs), *optional.items()]:
            given = getattr(e, name)
            values[i, start:end] = torch.tensor(given, dtype=torch.float32) if given is not None else math.nan

    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        old_logprobs=old_logprobs,
        advantages=torch.tensor([float(e.advantage) for e in experiences], dtype=torch.float32),
        vision=[encoded[g][1] for g in prompt_group],
        ref_logprobs=optional.get("ref_logprobs"),
        rollout_logprobs=optional.get("rollout_logprobs"),
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.long),
        prompt_group=torch.tensor(prompt_group, dtype=torch.long),
    )


def take_rows(batch: TrainBatch, rows: Sequence[int], trained: bool = True) -> TrainBatch:
    """The rows `rows` of `batch`, in that order, trimmed to their longest (what `collate`
    returns for those experiences alone). `trained=False` keeps the rows' forward but drops
    their trained positions: a micro-batch that runs the model and adds nothing to the step."""
    index = torch.tensor(list(rows), dtype=torch.long)
    if index.numel() == 0:
        raise ValueError("take_rows: no rows")
    length = int(batch.attention_mask[index].sum(-1).max())

    def cut(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[index, :length].clone()

    response_mask = cut(batch.response_mask)
    assert response_mask is not None
    if not trained:
        response_mask.zero_()
    group = None
    if batch.prompt_group is not None:
        first: dict[int, int] = {}
        group = torch.tensor(
            [first.setdefault(int(batch.prompt_group[r]), k) for k, r in enumerate(rows)], dtype=torch.long
        )
    return TrainBatch(
        input_ids=batch.input_ids[index, :length].clone(),
        attention_mask=batch.attention_mask[index, :length].clone(),
        response_mask=response_mask,
        old_logprobs=batch.old_logprobs[index, :length].clone(),
        advantages=batch.advantages[index].clone(),
        vision=[batch.vision[r] for r in rows],
        ref_logprobs=cut(batch.ref_logprobs),
        rollout_logprobs=cut(batch.rollout_logprobs),
        prompt_lens=None if batch.prompt_lens is None else batch.prompt_lens[index].clone(),
        prompt_group=group,
    )


def model_inputs(processor: ProcessorMixin, batch: TrainBatch, device: torch.device) -> dict[str, Tensor]:
    """Keyword arguments for a forward of `batch` on `device`.

    A sampled response may contain an image placeholder id (a random or badly behaved policy can
    emit one). The model treats every such id as a slot for image features and would fail (or
    misplace features), so on response positions it is fed as the pad token instead: its own
    log-prob is still read against the real id, only later tokens see the substitute.
    """
    ids = batch.input_ids
    family = family_of(processor)
    if family is None:
        # A text-only judge (a causal LM): token ids and the mask are all it takes.
        return {"input_ids": ids.to(device), "attention_mask": batch.attention_mask.to(device)}
    model_ids = _image_pads_as_pad(processor, ids, batch.response_mask > 0)
    inputs = {"input_ids": model_ids, "attention_mask": batch.attention_mask, **family.join(batch.vision)}
    if family.token_types is not None:
        inputs[family.token_types] = token_types(processor, model_ids)
    return {k: v.to(device) for k, v in inputs.items()}


def _image_pads_as_pad(processor: ProcessorMixin, ids: Tensor, where: Tensor) -> Tensor:
    """`ids` with the image placeholder ids (`placeholder_ids`) at `where` replaced by the pad."""
    placeholder = torch.isin(ids, torch.tensor(placeholder_ids(processor), dtype=ids.dtype))
    return torch.where(placeholder & where, torch.full_like(ids, processor.tokenizer.pad_token_id), ids)


def forward_logprobs(
    model: torch.nn.Module,
    processor: ProcessorMixin,
    batch: TrainBatch,
    device: torch.device | str = "cpu",
    temperature: float = 1.0,
    shared_prefix: bool = True,
    banned: Sequence[int] = (),
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
    packed: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    min_chunks: int = 0,
) -> tuple[Tensor, TokenStats]:
    """Log-prob of each next response token under logits / temperature, and the entropy and
    argmax of each of those distributions.

    Only the positions that predict a trained response token go through the output projection,
    `chunk_tokens` at a time (`_project_in_chunks`): the prompt, with its image tokens, is most of
    a judge's sequence, and a long response's [tokens, V] logits (kept for backward) would be
    most of the activation memory. With `shared_prefix` (and rows that share a prompt, as a
    GRPO group's samples do), each distinct prompt is forwarded once and its keys and values
    serve every response to it (`_shared_prefix_hidden`): the same numbers as one forward per
    row, with a fraction of the compute.

    Args:
        model: a Qwen-VL judge or a causal LM (or a DeepSpeed engine or PEFT model wrapping one).
        batch: from `collate`, B rows of padded length T.
        temperature: the rollout's sampling temperature, so that the log-probs and entropies are
            of the distribution the responses were sampled from.
        shared_prefix: forward a prompt that several rows share once (falls back to one forward
            per row when no prompt is shared, or under gradient checkpointing in training, which
            keeps no cache).
        banned: token ids taken out of the distribution (`ban_tokens`) before the log-softmax:
            the learner passes the judge's placeholder ids (`placeholder_ids`), which every
            rollout engine bans when it samples, so both sides compute the same distribution.
        chunk_tokens: positions projected at once (`LOGIT_CHUNK_TOKENS`).
        top_k, top_p: the rollout's truncation (`truncate_logits`; 0 and 1.0: none), applied
            after the temperature and the ban, so the log-probs are those the engines return
            and the entropy that of the distribution they drew from.
        min_chunks: project at least this many chunks, the extra ones a row of zeros that adds
            0 to the log-probs. Under ZeRO-3 each call of the output projection gathers its
            weight and each backward through it reduces the weight's gradient, collectives:
            ranks whose micro-batches hold different numbers of trained tokens must still call
            it as often as each other (the learner passes the most any rank needs).
        packed: where no prompt is shared, forward the rows' real tokens end to end as one
            sequence, each row attending only to itself (`_packed_hidden`), instead of B rows
            padded to T.

    Returns:
        (logp [B, T-1] float32, TokenStats of the N trained positions): logp[:, t] =
        log pi_T(input_ids[:, t+1] | ...) where response_mask[:, t+1] > 0, 0 elsewhere.
    """
    device = torch.device(device)
    predicts = (batch.response_mask[:, 1:] > 0).to(device)  # [B, T-1]: position t predicts a trained token
    # A DeepSpeed engine wraps the HF (or PEFT) model; a PEFT model hands the call on to it.
    head = getattr(model, "module", model).get_output_embeddings()
    if shared_prefix and can_share_prefix(model, batch):
        hidden, empty = _shared_prefix_hidden(model, processor, batch, device, head)
    elif packed:
        hidden, empty = _packed_hidden(model, processor, batch, device, head, predicts)
    else:
        with _projection_inputs(head) as seen:
            out = model(**model_inputs(processor, batch, device), use_cache=False)
        hidden, empty = seen[0][:, :-1][predicts], out.logits.sum()
    labels = batch.input_ids[:, 1:].to(device)[predicts]
    ban = torch.tensor(list(banned), dtype=torch.long)
    picked, entropy, greedy, nothing = _project_in_chunks(
        head, hidden, labels, temperature, ban, chunk_tokens, top_k, top_p, min_chunks
    )
    logp = torch.zeros(predicts.shape, dtype=picked.dtype, device=device).masked_scatter(predicts, picked)
    # `empty` is 0 (the sum of the model's empty logits) but makes the loss reach the model's own
    # output, ahead of the output projection's weight: a DeepSpeed engine starts its backward
    # (ZeRO's accumulation boundary and hook counts) from hooks on what its forward returned.
    return logp + empty + nothing, TokenStats(entropy, greedy)


@contextlib.contextmanager
def _projection_inputs(head: torch.nn.Module) -> Iterator[list[Tensor]]:
    """Inside, each call of the output projection `head` (an HF model's forward projects
    `hidden_states[:, -logits_to_keep:]` through it) appends its input to the yielded list and
    projects no position: the model returns [B, 0, V] logits, `_project_in_chunks` the rest."""
    seen: list[Tensor] = []

    def keep_and_empty(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        seen.append(args[0])
        return (args[0][:, :0], *args[1:])

    handle = head.register_forward_pre_hook(keep_and_empty)
    try:
        yield seen
    finally:
        handle.remove()


def _project_in_chunks(
    head: torch.nn.Module,
    hidden: Tensor,
    labels: Tensor,
    temperature: float,
    ban: Tensor,
    chunk_tokens: int,
    top_k: int = 0,
    top_p: float = 1.0,
    min_chunks: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob of each label [N] float32, entropy [N], argmax [N], and a 0 that carries the
    filler chunks up to `min_chunks` into the loss) under head(hidden) / temperature with `ban`
    out and top-k / top-p applied, for hidden [N, H] and labels [N].

    Each chunk of `chunk_tokens` rows runs under non-reentrant checkpointing, so its logits are
    freed once its three [chunk] results exist and recomputed in its backward: neither pass
    holds more than one chunk's logits."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    head = _frozen_partitioned_head(head)
    pieces = [
        checkpoint(
            _chunk_stats,
            head,
            hidden[start : start + chunk_tokens],
            labels[start : start + chunk_tokens],
            temperature,
            ban,
            top_k,
            top_p,
            use_reentrant=False,
        )
        for start in range(0, hidden.shape[0], chunk_tokens)
    ]
    # Up to `min_chunks`: one-row chunks of zeros whose log-probs enter the loss times 0, so their
    # projection runs in the forward, in the recomputation and in the weight's backward alike.
    # The row is taken from `hidden` (its sum times 0), so that its backward also reaches the
    # model, as a real chunk's does: under ZeRO-3 a filler that reached the head alone was seen
    # to put a rank's gathers out of step with another rank's real chunks (a crashed collective).
    missing = min_chunks - len(pieces)
    zero_row = hidden.sum(0, keepdim=True) * 0.0 if missing > 0 else None
    fillers = [
        checkpoint(
            _chunk_stats,
            head,
            zero_row,
            labels.new_zeros(1),
            temperature,
            ban,
            top_k,
            top_p,
            use_reentrant=False,
        )[0].sum()
        * 0.0
        for _ in range(missing)
    ]
    nothing = sum(fillers, hidden.new_zeros((), dtype=torch.float32))
    if not pieces:
        none = hidden.new_zeros(0, dtype=torch.float32)
        return none, none, labels.new_zeros(0), nothing
    picked, entropy, greedy = zip(*pieces)
    return torch.cat(picked), torch.cat(entropy), torch.cat(greedy), nothing


def _frozen_partitioned_head(head: torch.nn.Module) -> torch.nn.Module:
    """`head`, or where its weight is a frozen ZeRO-3 partition (LoRA under ZeRO-3), a module
    projecting through one full copy of it, gathered here once. ZeRO-3 gathers a frozen
    module's weight for its forward but not for the recomputation of a checkpointed chunk in
    backward, which would then see the empty partition; the copy (vocab x hidden, ~1 GB for a
    7B judge in bf16) lives until the micro-batch's backward has run."""
    weight = head.weight
    if not hasattr(weight, "ds_id") or weight.requires_grad:
        return head
    import deepspeed

    with deepspeed.zero.GatheredParameters([weight]):
        full = weight.detach().clone()
    bias = getattr(head, "bias", None)
    if bias is not None:
        with deepspeed.zero.GatheredParameters([bias]):
            bias = bias.detach().clone()
    return _Projection(full, bias)


class _Projection(torch.nn.Module):
    """hidden @ weight.T (+ bias) with fixed tensors: a gathered copy of an output projection."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.nn.functional.linear(hidden, self.weight, self.bias)


def _chunk_stats(
    head: torch.nn.Module, hidden: Tensor, labels: Tensor, temperature: float, ban: Tensor, top_k: int, top_p: float
) -> tuple[Tensor, Tensor, Tensor]:
    """`_project_in_chunks` of one chunk: the logits in the model's dtype, scaled, banned and
    truncated as the rollout engines sample, then read in float32 (`token_logprobs`,
    `entropy_from_logits`)."""
    logits = head(hidden)  # [C, V]
    if temperature != 1.0:
        # In place: a second [C, V] tensor would double the chunk. The projection's backward
        # does not read its output, so autograd allows it.
        logits.div_(temperature)
    ban_tokens(logits, ban)
    truncate_logits(logits, top_k, top_p, keep=labels)
    logp = token_logprobs(logits, labels)
    with torch.no_grad():
        return logp, entropy_from_logits(logits), logits.argmax(-1)


def _packed_hidden(
    model: torch.nn.Module,
    processor: ProcessorMixin,
    batch: TrainBatch,
    device: torch.device,
    head: torch.nn.Module,
    predicts: Tensor,
) -> tuple[Tensor, Tensor]:
    """`_shared_prefix_hidden`'s result for a forward without padding: the B rows' real tokens
    laid end to end as one sequence [1, N] with no attention mask, and each row's own position
    ids, restarting at 0. transformers reads the restarts as sequence boundaries: a block-diagonal
    causal mask for eager and SDPA attention, variable-length kernels for flash attention. A
    Qwen-VL judge gets each row's M-RoPE positions (from the padded batch, so identical to the
    unpacked forward's), led by the plain per-row positions that mark the boundaries ([4, 1, N]);
    its images keep their order, the order of their placeholders in the packed sequence."""
    # Laid out on the CPU, where the batch is, and moved to `device` once, packed.
    inputs = model_inputs(processor, batch, torch.device("cpu"))
    real = batch.attention_mask.bool()
    text = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]: 0, 1, ... per row
    family = family_of(processor)
    packed: dict[str, Any] = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    packed["input_ids"] = inputs["input_ids"][real][None]
    if family is not None and family.token_types is not None:
        packed[family.token_types] = inputs[family.token_types][real][None]
    if family is not None and family.mrope:
        rope, _ = prompt_positions(model, inputs)  # [3, B, T]
        packed["position_ids"] = torch.cat([text[real][None, None], rope[:, real][:, None]])
    else:
        packed["position_ids"] = text[real][None]
    with _projection_inputs(head) as seen:
        out = model(
            **{k: v.to(device) if v is not None else None for k, v in packed.items()},
            attention_mask=None,
            use_cache=False,
        )
    # Where each padded position [B, T] sits in the packed sequence (real positions only).
    where = (real.flatten().cumsum(0) - 1).view(real.shape)[:, :-1].to(device)
    return seen[0][0][where[predicts]], out.logits.sum()


def forwarded_positions(batch: TrainBatch, shared: bool, packed: bool = False) -> tuple[int, int]:
    """(padding positions, all positions) that `forward_logprobs` runs through the model for
    `batch`: B x T rows, with a shared prefix U distinct prompts x P plus B responses x R, packed
    the real tokens alone."""
    if packed and not shared:
        return 0, int(batch.attention_mask.sum())
    if not shared:
        return int((batch.attention_mask == 0).sum()), batch.attention_mask.numel()
    heads, plens, rlens = _prefix_layout(batch)
    total = len(heads) * int(plens[heads].max()) + plens.numel() * max(int(rlens.max()), 1)
    return total - int(plens[heads].sum()) - int(rlens.sum()), total


def _prefix_layout(batch: TrainBatch) -> tuple[list[int], Tensor, Tensor]:
    """(the first row of each distinct prompt, prompt lengths [B], response lengths [B])."""
    plens = batch.prompt_lens
    return sorted(set(batch.prompt_group.tolist())), plens, batch.attention_mask.sum(-1) - plens


def can_share_prefix(model: torch.nn.Module, batch: TrainBatch) -> bool:
    """Whether some rows share a prompt and the model can carry its keys and values over."""
    if batch.prompt_group is None or batch.prompt_lens is None:
        return False
    if len(set(batch.prompt_group.tolist())) == batch.prompt_group.numel() or int(batch.prompt_lens.min()) < 1:
        return False
    hf = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF (or PEFT) model
    return not (hf.training and getattr(hf, "is_gradient_checkpointing", False))


def _shared_prefix_hidden(
    model: torch.nn.Module,
    processor: ProcessorMixin,
    batch: TrainBatch,
    device: torch.device,
    head: torch.nn.Module,
) -> tuple[Tensor, Tensor]:
    """The inputs of the output projection `head` at the N positions that predict a trained
    response token [N, H] (row-major), with each distinct prompt forwarded once, and the sum of
    the forwards' (empty) logits (see `forward_logprobs`).

    1. The U distinct prompts, left-padded to P tokens, go through the model with their images;
       it returns their keys and values and the final hidden state of their last token (which
       predicts each response's first token).
    2. The cache is indexed out to the B rows (autograd sums the rows' gradients into the one
       prompt forward), and the right-padded responses [B, R] are forwarded on top of it, with
       explicit positions that continue each prompt's (for Qwen-VL, its M-RoPE positions from
       the model's own `get_rope_index`), so every token sees the keys and positions it sees in
       the unshared forward.
    """
    T = batch.input_ids.shape[1]
    pad_id = processor.tokenizer.pad_token_id
    heads, plens, rlens = _prefix_layout(batch)
    index = torch.tensor([heads.index(g) for g in batch.prompt_group.tolist()], dtype=torch.long)  # row -> prompt
    P, R = int(plens[heads].max()), max(int(rlens.max()), 1)

    ids = torch.full((len(heads), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(heads), P, dtype=torch.long)
    for u, h in enumerate(heads):
        n = int(plens[h])
        ids[u, P - n :], mask[u, P - n :] = batch.input_ids[h, :n], 1
    prompt: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    family = family_of(processor)
    if family is not None:
        prompt.update(family.join([batch.vision[h] for h in heads]))
        if family.token_types is not None:
            prompt[family.token_types] = token_types(processor, ids)
    # [3, U, P] for Qwen-VL (M-RoPE), [U, P] for a causal LM; following [U]: the position after each prompt
    prompt["position_ids"], following = prompt_positions(model, prompt)

    steps = torch.arange(R)
    real = steps[None, :] < rlens[:, None]  # [B, R]
    cols = (plens[:, None] + steps[None, :]).clamp(max=T - 1)
    response = torch.where(real, batch.input_ids.gather(1, cols), torch.full_like(cols, pad_id))
    fed = response
    if family is not None:  # as in `model_inputs`: a sampled image pad is fed as pad
        fed = _image_pads_as_pad(processor, response, real)
    positions = continued_positions(prompt["position_ids"], following[index], R)
    with _projection_inputs(head) as seen:
        out = model(**{k: v.to(device) for k, v in prompt.items()}, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_select_indices(index.to(device))
        out2 = model(
            input_ids=fed.to(device),
            attention_mask=torch.cat([mask[index], real.long()], 1).to(device),
            position_ids=positions.to(device),
            past_key_values=cache,
            use_cache=True,
        )
    # hidden[:, j] predicts response token j: the prompt's last state, then the responses'.
    hidden = torch.cat([seen[0][index.to(device)], seen[1][:, : R - 1]], dim=1)  # [B, R, H]
    trained = (batch.response_mask.gather(1, cols) > 0) & real
    return hidden[trained.to(device)], out.logits.sum() + out2.logits.sum()
