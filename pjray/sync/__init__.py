"""Weight sync, learner -> rollout engines: the learner's side of every transport (`sender`), the
broadcast group (`collective`), shared-memory buffers (`shared`), CUDA IPC handles (`ipc`), the
bucket plan they all use (`buckets`), the adapter-only message (`adapter`) and the driver's side,
one class per transport (`transports`, chosen once by `auto_transport`).

`pjray.rl.learner.LearnerRank` holds a `sender.WeightSender` and offers its methods as the actor's,
so every transport is a call the driver makes on the learner, while the learner file stays about
learning. Under ZeRO-3 the learner gathers parameters bucket by bucket
(`WeightSender.full_buckets`), so every learner rank must take part in a sync, even though only
rank 0 (or, for IPC, each rank for its own engine) sends.

Transports (`trainer.sync_backend`; each class of `transports` says how it works):
* `object_store`: rank 0 puts each packed bucket in the Ray object store once; every layout, and
  the CPU path across nodes.
* `nccl` / `gloo`: a broadcast group of learner rank 0 and every vLLM rank, one collective per
  bucket; NCCL for engines on GPUs of their own, gloo the same code on CPU tensors.
* `shm`: engines on learner rank 0's node copy from its buffers in shared memory.
* `ipc` (colocated): learner rank i streams its buckets to engine i on the same GPU through two
  reused CUDA buffers.
* with LoRA, model.lora.sync=adapter sends the adapter alone instead of the merged weights
  (`adapter`): for a 7B judge at rank 8, tens of MB instead of ~15 GB.

The receiving side of the broadcast and IPC paths is `pjray.rollout.vllm_engine.WeightSyncExtension`.
"""
